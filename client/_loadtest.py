"""`momlp loadtest` as a library: closed-loop (concurrency) or open-loop (Poisson rate) load.

`run_loadtest(config)` builds a route-verified workload, sends `POST /v1/predict` with
`return_stats=true` on every request, and returns a `LoadTestReport` (also written, when
`config.report_dir` is set, as report.json, report.html with its plots inlined, the PNG plots
and requests.csv). The clock, the sleep and the client are
injected so that tests drive it in-process against a fake server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

import httpx

from ._async_client import AsyncClient
from ._base import _check_gate
from ._conditions import ConditionWorkload
from ._eval import EvalSet, load_eval_set
from ._exceptions import (
    ConnectError,
    DecodingError,
    HTTPStatusError,
    MomlpError,
    NetworkError,
    TimeoutError,
    TransportError,
)
from ._html import write_html
from ._leases import ClientLeases
from ._models import ModelInfo
from ._plots import matplotlib_available, write_plots
from ._report import (
    LoadTestReport,
    RequestRecord,
    build_report,
    percentile,
    write_records_csv,
)
from ._server_counts import counter_delta, read_counters
from ._workload import Distribution, Workload, build_workload

__all__ = [
    "RECORDS_CSV_NAME",
    "Clock",
    "LoadTestConfig",
    "MonotonicClock",
    "arun_loadtest",
    "run_loadtest",
]

RECORDS_CSV_NAME = "requests.csv"

logger = logging.getLogger(__name__)


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


@dataclass(frozen=True)
class LoadTestConfig:
    """One load test. Stops after `requests` or `duration_s`, whichever comes first (one is
    required, except with `eval_data`: then both None is one pass over its rows); `rate`
    (requests/s, Poisson arrivals) switches from closed to open loop."""

    url: str = "http://127.0.0.1:8000"
    requests: int | None = 1000
    duration_s: float | None = None
    concurrency: int = 8
    rate: float | None = None
    batch: int = 1
    top_k: int = 1
    mode: Literal["tree", "exact"] | None = None
    distribution: str = "uniform"
    seed: int = 0
    report_dir: Path | None = None
    api_key: str | None = None
    timeout_s: float = 30.0
    max_retries: int = 0
    binary: bool | None = None
    save_requests: bool = False
    plots: bool = True
    candidates_per_expert: int = 8
    route_chunk_rows: int = 1024
    # Sent with every request: temperature, min_weight, top_p, beam, score (server caps apply).
    gate: dict[str, Any] | None = None
    # An .npz with `x` and `y`: send these rows and report accuracy (replaces the workload).
    eval_data: Path | None = None
    # Kind hyper: each row's condition drawn from `conditions` random ones under
    # `condition_distribution` (uniform or zipf:S); replaces the expert workload.
    conditions: int | None = None
    condition_distribution: str = "uniform"

    def __post_init__(self) -> None:
        Distribution.parse(self.distribution)
        Distribution.parse(self.condition_distribution)
        if self.conditions is not None and self.conditions < 1:
            raise ValueError("conditions must be >= 1")
        if self.requests is None and self.duration_s is None and self.eval_data is None:
            # With eval_data and neither, the run is one pass over its rows.
            raise ValueError("give requests or duration_s")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be > 0")
        if self.concurrency < 1 or self.batch < 1 or self.top_k < 1:
            raise ValueError("concurrency, batch and top_k must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        # Unknown gate fields fail here (exit 2), not on every request of the run.
        _check_gate(self.gate)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["report_dir"] = str(self.report_dir) if self.report_dir is not None else None
        data["eval_data"] = str(self.eval_data) if self.eval_data is not None else None
        data["api_key"] = "***" if self.api_key else None
        return data


ClientFactory = Callable[[LoadTestConfig], AsyncClient]
Sleep = Callable[[float], Awaitable[None]]


def default_client_factory(config: LoadTestConfig) -> AsyncClient:
    """A client for the load test's set-up, or for one request in flight at a time."""
    # Each client's transport would otherwise build its own TLS context, loading the CA
    # bundle (~17 ms on the 2-core VM), once for every client the leases make.
    transport = httpx.AsyncHTTPTransport(verify=_tls_context())
    return AsyncClient(
        config.url,
        api_key=config.api_key,
        timeout=config.timeout_s,
        max_retries=config.max_retries,
        transport=transport,
    )


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def run_loadtest(
    config: LoadTestConfig,
    *,
    client_factory: ClientFactory | None = None,
    clock: Clock | None = None,
    sleep: Sleep = asyncio.sleep,
    progress: TextIO | None = None,
) -> LoadTestReport:
    """Run a load test to completion (blocking; starts its own event loop)."""
    return asyncio.run(
        arun_loadtest(
            config, client_factory=client_factory, clock=clock, sleep=sleep, progress=progress
        )
    )


async def arun_loadtest(
    config: LoadTestConfig,
    *,
    client_factory: ClientFactory | None = None,
    clock: Clock | None = None,
    sleep: Sleep = asyncio.sleep,
    progress: TextIO | None = None,
) -> LoadTestReport:
    """`run_loadtest` for callers already inside an event loop."""
    clock = clock or MonotonicClock()
    # Looked up at call time so that the CLI test can swap the factory for a fake transport.
    factory = client_factory or default_client_factory
    async with factory(config) as client:
        model = await client.model(include_prototypes=config.eval_data is None)
        workload: Workload | ConditionWorkload | None = None
        evaluation: EvalSet | None = None
        if config.conditions is not None:
            workload = ConditionWorkload(
                model, conditions=config.conditions,
                distribution=Distribution.parse(config.condition_distribution), seed=config.seed,
            )
        elif config.eval_data is not None:
            evaluation = load_eval_set(
                config.eval_data, task=model.task, input_dim=model.input_dim,
                output_dim=model.output_dim,
            )
            if config.requests is None and config.duration_s is None:
                # One pass: a row sent again would weigh twice in the score.
                config = dataclasses.replace(
                    config, requests=evaluation.requests_per_pass(config.batch)
                )
        else:
            workload = await build_workload(
                client,
                model,
                distribution=Distribution.parse(config.distribution),
                seed=config.seed,
                mode=config.mode,
                candidates_per_expert=config.candidates_per_expert,
                route_chunk_rows=config.route_chunk_rows,
            )
        # A closed loop never has more than `concurrency` requests in flight. In an open loop,
        # arrivals beyond the limit wait for a client (in their latency, which counts from
        # the scheduled arrival), as they waited for one of the shared pool's connections.
        leases = ClientLeases(
            lambda: factory(config), max(100, config.concurrency), wait_s=config.timeout_s,
            url=f"{config.url.rstrip('/')}/v1/predict",
        )
        before = await read_counters(client)
        async with leases:
            runner = _Runner(config, leases, workload, clock, sleep, progress, evaluation)
            await runner.run()
        server_counts = counter_delta(before, await read_counters(client))
    duration = max((record.end_s for record in runner.records), default=0.0)
    records = sorted(runner.records, key=lambda record: record.index)
    if isinstance(workload, ConditionWorkload):
        workload_info = workload.describe()
    elif workload is not None:
        workload_info = workload.describe()
        workload_info["expected_frequencies"] = {
            str(expert): share
            for expert, share in sorted(workload.expected_frequencies().items())
        }
    else:
        assert evaluation is not None
        workload_info = {"distribution": f"eval rows of {evaluation.path}",
                         "eval_rows": len(evaluation)}
    report = build_report(
        records,
        duration_s=duration,
        dense_equivalent_bytes=_dense_bytes(model),
        max_expert_bytes=model.max_expert_bytes,
        config=config.to_dict(),
        model=model.model_dump(exclude={"prototypes"}),
        workload=workload_info,
        save_requests=config.save_requests,
        accuracy=_accuracy(evaluation, records),
        server_counts=server_counts,
    )
    if config.report_dir is not None:
        report = _write(report, config, records)
    return report


def _dense_bytes(model: ModelInfo) -> int:
    """All experts resident at once, in the measure of `vram_bytes`: what an actor holds of
    each, its float32 parameters (a file's bytes add its safetensors header, which for small
    experts is as large as the weights)."""
    return 4 * model.total_params if model.total_params > 0 else model.total_expert_bytes


def _accuracy(
    evaluation: EvalSet | None, records: list[RequestRecord]
) -> dict[str, Any] | None:
    """The --eval figure over every answered row (repeats counted when the file wraps)."""
    if evaluation is None:
        return None
    total = sum(r.eval_sum for r in records if r.ok and r.eval_sum is not None)
    count = sum(r.eval_count for r in records if r.ok)
    return {
        "metric": evaluation.metric,
        "value": total / count if count else None,
        "task": evaluation.task,
        "rows": sum(r.rows for r in records if r.ok),
        "values": count,
        "data": evaluation.path,
    }


def _write(
    report: LoadTestReport, config: LoadTestConfig, records: list[RequestRecord]
) -> LoadTestReport:
    assert config.report_dir is not None
    directory = Path(config.report_dir)
    if config.plots and matplotlib_available():
        vram = [float(r.vram_bytes) for r in records if r.ok and r.vram_bytes is not None]
        paths = write_plots(report, directory, vram_samples=vram)
        report = replace(report, plots=[path.name for path in paths])
    elif config.plots:
        report = replace(report, notes=[*report.notes, "plots skipped: matplotlib not installed"])
    report.write(directory)
    write_html(report, directory)
    write_records_csv(records, directory / RECORDS_CSV_NAME)
    return report


class _Runner:
    def __init__(
        self,
        config: LoadTestConfig,
        leases: ClientLeases,
        workload: Workload | ConditionWorkload | None,
        clock: Clock,
        sleep: Sleep,
        progress: TextIO | None,
        evaluation: EvalSet | None = None,
    ) -> None:
        self.config = config
        self.evaluation = evaluation
        self.leases = leases
        self.workload = workload
        self.clock = clock
        self.sleep = sleep
        self.records: list[RequestRecord] = []
        self.start = 0.0
        self._next_index = 0
        self._progress = _Progress(progress, config) if progress is not None else None

    async def run(self) -> None:
        self.start = self.clock.now()
        if self.config.rate is None:
            await asyncio.gather(*(self._worker() for _ in range(self.config.concurrency)))
        else:
            await self._open_loop(self.config.rate)
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
        try:
            async with self.leases.lease() as client:
                prediction = await client.predict(
                    rows, top_k=config.top_k, mode=config.mode, return_stats=True,
                    binary=config.binary, gate=config.gate, conditions=conditions,
                )
        except MomlpError as exc:
            record = RequestRecord(index, start_s, self._elapsed(), len(rows), _status(exc))
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
            )
        self.records.append(record)
        if self._progress is not None:
            self._progress.update(self.records, record.end_s)


def _status(exc: MomlpError) -> str:
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


class _Progress:
    """A live `\\r` line on a stream: done/total, req/s, p50 of the latest answers, errors.

    On a stream that is not a terminal (a log file, CI) `\\r` would glue the updates into
    one line, so there each update is its own line, and they come less often. Each update
    reads only the records that came since the last one and takes the p50 of the latest
    `recent` answers: over every answer so far, an update of a long run sorted hundreds of
    thousands of latencies twice a second on the event loop the requests wait on.
    """

    def __init__(
        self,
        stream: TextIO,
        config: LoadTestConfig,
        interval_s: float = 0.5,
        recent: int = 1000,
    ) -> None:
        self.stream = stream
        self.config = config
        isatty = getattr(stream, "isatty", None)
        self._live = bool(isatty()) if callable(isatty) else False
        self.interval_s = interval_s if self._live else max(interval_s, 5.0)
        self._last = -self.interval_s
        self._seen = 0
        self._errors = 0
        self._recent: deque[float] = deque(maxlen=recent)

    def update(self, records: list[RequestRecord], elapsed: float) -> None:
        if elapsed - self._last >= self.interval_s:
            self._last = elapsed
            self._write(records, elapsed)

    def finish(self, records: list[RequestRecord], elapsed: float) -> None:
        self._write(records, elapsed)
        if self._live:
            self.stream.write("\n")
        self.stream.flush()

    def _write(self, records: list[RequestRecord], elapsed: float) -> None:
        for record in records[self._seen :]:
            if record.ok:
                self._recent.append(record.latency_ms)
            else:
                self._errors += 1
        done = self._seen = len(records)
        if self.config.requests is not None:
            where = f"{done}/{self.config.requests}"
        else:
            where = f"{done} req, {elapsed:.0f}/{self.config.duration_s:.0f} s"
        rate = done / elapsed if elapsed > 0 else 0.0
        p50 = percentile(list(self._recent), 50) if self._recent else 0.0
        line = (
            f"{where}  {rate:.1f} req/s  p50 {p50:.1f} ms (last {len(self._recent)})"
            f"  errors {self._errors}"
        )
        self.stream.write(f"\r{line}   " if self._live else f"{line}\n")
        self.stream.flush()
