"""Merge concurrent requests into batches: one router call, one pool call per batch.

Requests with the same options (the kind's resolved gate) that arrive within
`max_batch_wait_ms` of the first one are merged up to `max_batch_rows` rows. A window closes
early once no request has joined it for `batch_gap_ms`, and at once when every open HTTP
connection already has a request in this batcher (`OpenConnections`: nobody else can send).
A batch is routed by the store's kind (on the event loop when recent batches say it is cheap,
else in a thread: `RouteRunner`), which plans groups (cache key, rows, gate weights);
the pool runs each round's groups and the kind combines them; each request then gets its own
rows back in order, with per-group stats.

Prefetch: while every batch slot is busy, the requests waiting at the head of the queue are
routed ahead of time and their experts' home actors start loading them, so the loads overlap
the earlier batches' compute. A routing made that way is kept and reused when the request's
batch runs (routing is row by row, so it is the same answer). The batch about to run is never
prefetched for itself: its own call loads what it misses, and its stats then say "miss".

A request's check before it is queued: _inputs.py; a queued request and which queued requests
make up a batch: _pending.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import numpy as np
import torch

from experts_store import Clock, MonotonicClock
from router import RouterInputError
from server._exceptions import ActorFailed, InvalidRequest, PoolClosed, PoolSaturated
from server._settings import Settings
from server.batching._assemble import BatchAnswers, Round
from server.batching._inputs import checked_rows
from server.batching._pending import Pending, fail, prefetch_head, take_batch, waited
from server.batching._route import RouteRunner
from server.batching._types import BatchAnswer
from server.kinds import GateRequest, ServedModel
from server.pool import ExpertPool, calls_settled

__all__ = ["Batcher"]

logger = logging.getLogger(__name__)

class Batcher:
    """Turns single requests into batched router and pool calls; see the module docstring.

    One batcher serves one store version: `model` (its kind's planner/combiner, with its
    router and `ExpertRef`s) is that version's, so every request it answers is served by one
    version.
    `sleep` is injectable with `clock` so that tests drive the batch window without waiting;
    `cpu_clock` times routing (a thread's CPU seconds) to decide where it runs (`RouteRunner`).
    The batcher does not own the pool: `close()` stops batching, the server closes the pool.
    """

    def __init__(
        self,
        model: ServedModel,
        pool: ExpertPool,
        settings: Settings,
        clock: Clock | None = None,
        *,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        max_inflight_batches: int = 2,
        cpu_clock: Clock | None = None,
        open_connections: Callable[[], int | None] | None = None,
        queued_elsewhere: Callable[[Batcher], int] | None = None,
    ) -> None:
        self._model = model
        # Rows the server's other batchers hold, given the asking one (after a swap the
        # replaced version's and the new one's each hold rows until their requests are
        # answered): they count against `max_queue_rows` too.
        self._queued_elsewhere = queued_elsewhere
        self._pool = pool
        self._settings = settings
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._sleep = sleep if sleep is not None else asyncio.sleep
        self._window_s = settings.max_batch_wait_ms / 1000.0
        self._gap_s = settings.batch_gap_ms / 1000.0
        self._route = RouteRunner.for_settings(model.route, settings, cpu_clock)
        self._queue: deque[Pending] = deque()
        self._queued_rows = 0
        self._wakeup: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._max_inflight = max_inflight_batches
        self._collector: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._rows_per_s: float | None = None
        self._prefetching: asyncio.Task[None] | None = None
        self._prefetch_on = (
            settings.prefetch
            if settings.prefetch is not None
            else pool.device.startswith("cuda")
        )
        self._closed = False
        self._checked_options: set[Hashable] = set()  # see `checked_rows`
        self._open_connections = open_connections
        # Callers waiting for an answer, queued or in a running batch. It follows the callers,
        # not their rows (unlike `_queued_rows`): one that left (a timeout) frees its
        # connection to send again, so it must not count as a connection that cannot.
        self._waiting = 0
        self.batches = 0  # batches dispatched so far (for tests and metrics)

    @property
    def queued_rows(self) -> int:
        """Rows admitted and not yet computed: queued, or in a batch still running (also when
        their caller has left, as its timeout does not stop the batch, and when the batch
        failed while other calls of it still compute)."""
        return self._queued_rows

    async def submit(
        self, x: torch.Tensor | np.ndarray, options: Hashable | None = None
    ) -> BatchAnswer:
        """Route and run one request; outputs come back in the order of its rows.

        `options` are the kind's resolved options (`model.resolve(...)`; None: the store's
        defaults). Raises `InvalidRequest` (shape, dimension, non-finite, options), `PoolSaturated`
        when the queue is full, `ExpertUnavailable` when one of its experts cannot be loaded,
        `PoolClosed` after `close()`.
        """
        if self._closed:
            raise PoolClosed()
        if options is None:
            options = self._model.resolve(GateRequest(), self._settings)
        # A module function given the state: on every request, no dearer than a method call.
        x = checked_rows(x, options, self._model, self._checked_options)
        rows = int(x.shape[0])
        limit = self._settings.max_queue_rows
        queued = self._queued_rows
        if self._queued_elsewhere is not None:
            queued += self._queued_elsewhere(self)
        if queued > 0 and queued + rows > limit:
            raise PoolSaturated(
                queued_rows=queued,
                max_queue_rows=limit,
                retry_after_s=self._retry_after_s(),
            )
        loop = asyncio.get_running_loop()
        item = Pending(x, options, self._clock.now(), loop.create_future())
        self._queue.append(item)
        self._queued_rows += rows
        self._waiting += 1
        self._start(loop)
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            build = await item.future
        finally:
            self._waiting -= 1
            if not item.dispatched:
                # Left (or failed) while queued: no batch will take it, its rows never run.
                self._queued_rows -= rows
        return build()

    def _retry_after_s(self) -> float:
        if not self._rows_per_s:
            return 1.0
        return float(min(30.0, max(0.05, self._queued_rows / self._rows_per_s)))

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._collector is None:
            if self._wakeup is None or self._slots is None:
                self._wakeup = asyncio.Event()
                self._slots = asyncio.Semaphore(self._max_inflight)
            self._collector = loop.create_task(self._collect())
            self._collector.add_done_callback(self._collector_done)

    def _collector_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in batching must not leave callers waiting forever: fail what is queued and
        # let the next submit start a fresh collector.
        logger.error("the batch collector failed", exc_info=task.exception())
        error = task.exception()
        self._collector = None
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(error if error is not None else PoolClosed())

    async def _collect(self) -> None:
        assert self._wakeup is not None and self._slots is not None
        while not self._closed:
            self._drop_cancelled()
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self._prefetch_on and self._slots.locked():
                self._start_prefetch()
            await self._slots.acquire()
            try:
                await self._wait_for_window()
                batch = self._take_batch()
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._process(batch))
            self._inflight.add(task)
            task.add_done_callback(functools.partial(self._batch_done, batch))

    def _start_prefetch(self) -> None:
        """Route the queue's head ahead of its batch and warm its experts' home actors."""
        if self._prefetching is not None and not self._prefetching.done():
            return
        head = prefetch_head(self._queue, self._settings.max_batch_rows)
        if head:
            self._prefetching = asyncio.get_running_loop().create_task(self._prefetch(head))

    async def _prefetch(self, items: list[Pending]) -> None:
        try:
            x = items[0].x if len(items) == 1 else torch.cat([item.x for item in items])
            routing = await self._route(x, items[0].options)
            start = 0
            for item in items:
                stop = start + item.rows
                item.routing = routing.slice(start, stop)
                start = stop
            await self._pool.prefetch(self._model.prefetch_keys(routing))
        except Exception:
            # Prefetch is only a hint: the batch routes (and reports bad input) for itself.
            logger.debug("prefetch of %s queued requests failed", len(items), exc_info=True)

    def _release(self, items: list[Pending]) -> None:
        """Take the items' rows off `queued_rows` (once each)."""
        for item in items:
            if item.counted:
                item.counted = False
                self._queued_rows -= item.rows

    def _batch_done(self, batch: list[Pending], task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        # `_process` released them; a batch cancelled (a close) before its first step, or while
        # a failure's other calls settled, did not.
        self._release(batch)
        if self._slots is not None:
            self._slots.release()
        if task.cancelled():
            # A close: whether the task was cancelled mid-batch or before its first step (in
            # the turn it was made, when `_process` never ran), no request of it is answered.
            fail(batch, PoolClosed())

    def _drop_cancelled(self) -> None:
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()

    def _no_other_senders(self) -> bool:
        """Whether every open connection has a request in this batcher (see _senders)."""
        if self._open_connections is None:
            return False
        connections = self._open_connections()
        # 0 connections with requests waiting: they came another way (in-process ASGI).
        return connections is not None and 0 < connections <= self._waiting

    async def _wait_for_window(self) -> None:
        """Wait until the first request's window closes (at its end, once no request has
        joined it for the gap, or once no other client can send one) or its key has a full
        batch."""
        assert self._wakeup is not None
        while True:
            self._drop_cancelled()
            if not self._queue:
                return
            first = self._queue[0]
            same = sum(p.rows for p in self._queue if p.key == first.key)
            # The window closes at its end, or earlier once no request has joined for the
            # gap: a burst that has all arrived need not wait out the rest.
            closes = first.submitted + self._window_s
            if self._gap_s > 0:
                closes = min(closes, self._queue[-1].submitted + self._gap_s)
            remaining = closes - self._clock.now()
            if same >= self._settings.max_batch_rows or remaining <= 0:
                return
            if self._no_other_senders():
                return
            self._wakeup.clear()
            sleeper = asyncio.ensure_future(self._sleep(remaining))
            waiter = asyncio.ensure_future(self._wakeup.wait())
            try:
                await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                waiter.cancel()

    def _take_batch(self) -> list[Pending]:
        self._drop_cancelled()
        batch, self._queue = take_batch(self._queue, self._settings.max_batch_rows)
        return batch

    async def _process(self, batch: list[Pending]) -> None:
        started = self._clock.now()
        self.batches += 1
        try:
            answers = await self._run_batch(batch, started)
        except RouterInputError as exc:
            if len(batch) > 1:
                # One bad request must not fail the others merged with it: route each alone.
                await asyncio.gather(*(self._process([item]) for item in batch))
            else:
                self._release(batch)
                fail(batch, InvalidRequest(str(exc), field="inputs"))
            return
        except Exception as exc:
            if isinstance(exc, ActorFailed):
                # The pool logged why (once); a traceback per batch would flood an outage's log.
                logger.warning("batch of %s requests failed: %s", len(batch), exc)
            elif not isinstance(exc, PoolClosed | InvalidRequest):
                logger.exception("batch of %s requests failed", len(batch))
            fail(batch, exc)
            # Answered at once, but the slot stays taken (this task is the slot) until the
            # batch's other actor calls have ended: else the next batch would start while
            # they compute, past max_inflight_batches. Its rows stay in `queued_rows` as
            # long, as a running batch's do (else 429 admitted a queue's worth more behind
            # the slot). Released in this turn when nothing still computes (`calls_settled`
            # then returns without waiting), so a caller answered sees its rows off the count.
            await calls_settled(exc)
            self._release(batch)
            return
        self._release(batch)
        for r, item in enumerate(batch):
            if not item.future.done():
                failure = answers.failure(r)
                if failure is not None:
                    item.future.set_exception(failure)
                else:
                    item.future.set_result(functools.partial(answers.answer, r))
        elapsed = self._clock.now() - started
        rows = sum(item.rows for item in batch)
        if elapsed > 0:
            rate = rows / elapsed * self._max_inflight
            previous = self._rows_per_s
            self._rows_per_s = rate if previous is None else 0.8 * previous + 0.2 * rate

    async def _run_batch(self, batch: list[Pending], started: float) -> BatchAnswers:
        x = batch[0].x if len(batch) == 1 else torch.cat([item.x for item in batch])
        routing: Any
        if all(item.routing is not None for item in batch):
            routing = self._model.concat([item.routing for item in batch])
        else:
            routing = await self._route(x, batch[0].options)
        route_ms = (self._clock.now() - started) * 1000.0
        run = self._model.start(x, routing)
        rounds: list[Round] = []
        # Asked only after an actor's death or hang: a retry then skipped when no one waits.
        wanted = functools.partial(waited, batch)
        while (plan := run.plan()) is not None:
            results = await self._pool.run(plan.pool_groups(), wanted=wanted)
            run.combine(plan, results)
            rounds.append((plan, results))
        return BatchAnswers(
            [(item.rows, item.submitted) for item in batch], routing, run.outputs, rounds,
            route_ms, started, self._clock.now(),
        )

    async def close(self) -> None:
        """Stop batching: queued and in-flight requests fail with `PoolClosed`."""
        self._closed = True
        tasks: list[asyncio.Task[Any]] = list(self._inflight)
        if self._collector is not None:
            tasks.append(self._collector)
        if self._prefetching is not None:
            tasks.append(self._prefetching)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        # A cancelled task keeps its CancelledError, whose traceback holds the frame that
        # holds this batcher: kept here too, that is a cycle that took the whole retired
        # store version with it, which only the cyclic collector frees, and never once a
        # swap's gc.freeze() has set it aside (server/serving/_collect.py).
        self._collector = self._prefetching = None
        self._inflight.clear()
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(PoolClosed())
