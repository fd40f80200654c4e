"""The load test's request loop: closed (`concurrency` workers) or open (Poisson arrivals).

`Runner` sends the requests through leased clients and keeps one `RequestRecord` per request;
time comes from an injected `Clock` and `Sleep`, so that tests drive it with a fake clock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TextIO

from ._conditions import ConditionWorkload
from ._eval import EvalSet
from ._exceptions import (
    ConnectError,
    DecodingError,
    HTTPStatusError,
    MomlpError,
    NetworkError,
    TimeoutError,
    TransportError,
)
from ._leases import ClientLeases
from ._loadtest_config import LoadTestConfig
from ._progress import Progress
from ._records import RequestRecord
from ._workload import Workload

__all__ = [
    "CLIENT_BUSY", "FREEZE_EVERY", "Clock", "MonotonicClock", "Runner", "Sleep", "request_status"
]

# The status of a request that never left the generator: every one of its clients stayed busy
# for longer than the request's timeout. A "timeout" would blame the server for it.
CLIENT_BUSY = "client_busy"

# Records between two freezes of what is alive out of the cyclic GC (`freeze_every`): each
# freeze first collects what is not frozen yet, about this many records (a few ms).
FREEZE_EVERY = 4096

logger = logging.getLogger(__name__)


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


Sleep = Callable[[float], Awaitable[None]]


class Runner:
    """Sends one load test's requests and keeps a record of each in `records`."""

    def __init__(
        self,
        config: LoadTestConfig,
        leases: ClientLeases,
        workload: Workload | ConditionWorkload | None,
        clock: Clock,
        sleep: Sleep,
        progress: TextIO | None,
        evaluation: EvalSet | None = None,
        freeze_every: int = 0,
    ) -> None:
        """`freeze_every`: each time this many more records are kept (and once before the
        first request), collect garbage and freeze what is alive out of the cyclic GC
        (`_freeze_alive`), and hand it all back when the run ends; 0: never. It acts on the
        whole process (another freeze's objects are handed back too), so the CLI asks for it."""
        self.config = config
        self.evaluation = evaluation
        self.leases = leases
        self.workload = workload
        self.clock = clock
        self.sleep = sleep
        self.records: list[RequestRecord] = []
        self.start = 0.0
        self._next_index = 0
        self._progress = Progress(progress, config) if progress is not None else None
        self._freeze_every = freeze_every

    async def run(self) -> None:
        if self._freeze_every:
            _freeze_alive()  # the workload and imports, before any request waits on it
        self.start = self.clock.now()
        try:
            if self.config.rate is None:
                await asyncio.gather(*(self._worker() for _ in range(self.config.concurrency)))
            else:
                await self._open_loop(self.config.rate)
        finally:
            if self._freeze_every:
                gc.unfreeze()  # the report's work may pause; no request waits on it
        if self._progress is not None:
            self._progress.finish(self.records, self.clock.now() - self.start)

    def _elapsed(self) -> float:
        return self.clock.now() - self.start

    def _more(self, index: int, elapsed: float) -> bool:
        if self.config.requests is not None and index >= self.config.requests:
            return False
        return self.config.duration_s is None or elapsed < self.config.duration_s

    async def _worker(self) -> None:
        while self._more(self._next_index, self._elapsed()):
            index = self._next_index
            self._next_index += 1
            rows, positions, extra = self._rows(index)
            await self._one(index, rows, self._elapsed(), positions, extra)

    async def _open_loop(self, rate: float) -> None:
        arrivals = random.Random(self.config.seed + 2)
        pending: set[asyncio.Task[None]] = set()
        index, scheduled = 0, arrivals.expovariate(rate)
        while self._more(index, scheduled):
            wait = scheduled - self._elapsed()
            if wait > 0:
                await self.sleep(wait)
            rows, positions, extra = self._rows(index)
            # Latency counts from the scheduled arrival, so a slow server cannot hide queueing
            # by delaying the sends (no coordinated omission).
            task = asyncio.create_task(self._one(index, rows, scheduled, positions, extra))
            pending.add(task)
            task.add_done_callback(pending.discard)
            index += 1
            scheduled += arrivals.expovariate(rate)
        await asyncio.gather(*pending)

    def _rows(
        self, index: int
    ) -> tuple[list[list[float]], list[int] | None, dict[str, Any] | None]:
        """Request `index`'s rows, which --eval rows they are (None without --eval) and its
        conditions (kind hyper; None otherwise)."""
        if self.evaluation is not None:
            positions = self.evaluation.positions(index, self.config.batch)
            return self.evaluation.rows(positions), positions, None
        assert self.workload is not None
        if isinstance(self.workload, ConditionWorkload):
            rows, conditions = self.workload.next_request(self.config.batch)
            return rows, None, conditions
        return self.workload.next_request(self.config.batch), None, None

    async def _one(
        self,
        index: int,
        rows: list[list[float]],
        start_s: float,
        positions: list[int] | None,
        conditions: dict[str, Any] | None = None,
    ) -> None:
        config = self.config
        sent_s: float | None = None
        try:
            async with self.leases.lease() as client:
                # When the request leaves: in an open loop, its lag behind the scheduled
                # arrival is the generator's own delay (a busy event loop, or no free client).
                sent_s = self._elapsed()
                prediction = await client.predict(
                    rows, top_k=config.top_k, mode=config.mode, return_stats=True,
                    binary=config.binary, gate=config.gate, conditions=conditions,
                )
        except MomlpError as exc:
            status = CLIENT_BUSY if sent_s is None else request_status(exc)
            record = RequestRecord(
                index, start_s, self._elapsed(), len(rows), status, sent_s=sent_s
            )
            logger.debug("request %d failed: %s", index, exc)
        else:
            stats = prediction.stats
            expert_rows: dict[int, int] = {}
            for stat in stats.experts if stats is not None else []:
                expert_rows[stat.expert_id] = expert_rows.get(stat.expert_id, 0) + stat.rows
            eval_sum, eval_count = None, 0
            if self.evaluation is not None and positions is not None:
                eval_sum, eval_count = self.evaluation.score(positions, prediction.outputs)
            record = RequestRecord(
                index,
                start_s,
                self._elapsed(),
                len(rows),
                "200",
                hits=stats.hits if stats is not None else 0,
                misses=stats.misses if stats is not None else 0,
                vram_bytes=stats.vram_bytes if stats is not None else None,
                device_bytes=dict(stats.device_bytes) if stats is not None else {},
                expert_rows=expert_rows,
                kept=sum(len(experts) for experts in prediction.experts),
                condition_keys=tuple(sorted(
                    {stat.key for stat in stats.experts if stat.key is not None}
                    if stats is not None else ()
                )),
                eval_sum=eval_sum,
                eval_count=eval_count,
                sent_s=sent_s,
            )
        self.records.append(record)
        if self._freeze_every and len(self.records) % self._freeze_every == 0:
            _freeze_alive()
        if self._progress is not None:
            self._progress.update(self.records, record.end_s)


def _freeze_alive() -> None:
    # Every record is kept to the end of the run, and each full collection of the cyclic GC
    # traversed them all: all clients stalled at once, longer as the run went on (2.06 s
    # after 1.29 million requests in a 45-minute run beside the server on 2 cores), and each
    # request in flight counted the stall as the server's latency. Garbage is collected
    # first, so that only live objects (the records, mostly) leave the collector's reach.
    gc.collect()
    gc.freeze()


def request_status(exc: MomlpError) -> str:
    """A failed request's status in its record: the HTTP code, else the kind of failure."""
    if isinstance(exc, HTTPStatusError):
        return str(exc.status_code)
    for cls, name in (
        (ConnectError, "connect"),
        (TimeoutError, "timeout"),
        (NetworkError, "network"),
        (DecodingError, "decoding"),
        (TransportError, "protocol"),
    ):
        if isinstance(exc, cls):
            return name
    return "client"
