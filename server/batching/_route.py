"""Where a batch (or a /v1/route request) is routed: on the event loop when it is cheap, in a
worker thread otherwise.

Routing is CPU work on tensors. A large batch on a large store takes milliseconds and must
not stall every other request, so it goes to a thread; but handing a thread a batch of a few
rows costs more than routing it: a thread wake-up, and a wait for the GIL while the event
loop holds it (up to the interpreter's 5 ms switch interval). On 2 cores with 4-row requests
(batches of ~50 rows, ~0.3-0.5 ms of routing), a 2 ms bound gave 1.00-1.27x the rows/s of
always using a thread in 8/8 alternating pairs, median 1.10x, with less CPU per row
(benchmarks/RESULTS.md, "routing on the event loop").

The cost of a batch is estimated from the CPU time recent batches took, measured with a clock
of the routing thread's own CPU time (so waits for the GIL do not count). Routing a few rows
costs mostly a fixed part (a tree walk of small tensor operations: ~0.28 ms for 4 rows and
~0.29 ms for 32 on the issue-19 store), so the estimate is the recent cost of a batch, scaled
up in proportion for a batch larger than the recent ones and never scaled down. Routing runs in
a thread until there is an estimate, and whenever the estimate for the batch at hand is above
the bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from experts_store import Clock
from server._settings import Settings

__all__ = ["RouteRunner", "ThreadCpuClock"]

# Weight of the newest batch in the estimates: a few batches correct a first guess
# that an import or a cold cache inflated.
_SMOOTHING = 0.2


class ThreadCpuClock:
    """CPU seconds of the calling thread (meaningful only as a difference in one thread)."""

    def now(self) -> float:
        return time.thread_time()


class RouteRunner:
    """Calls `route(x, options)` inline if its estimated CPU time is at most `inline_s`.

    `inline_s` 0 sends every batch to a thread.
    """

    @classmethod
    def for_settings(
        cls,
        route: Callable[[torch.Tensor, Hashable], Any],
        settings: Settings,
        cpu_clock: Clock | None = None,
    ) -> RouteRunner:
        """A runner with the server's bound (`inline_route_ms`)."""
        return cls(route, settings.inline_route_ms / 1000.0, cpu_clock)

    def __init__(
        self,
        route: Callable[[torch.Tensor, Hashable], Any],
        inline_s: float,
        cpu_clock: Clock | None = None,
    ) -> None:
        self._route = route
        self._inline_s = inline_s
        self._cpu_clock: Clock = cpu_clock if cpu_clock is not None else ThreadCpuClock()
        self._batch_s: float | None = None  # recent CPU seconds per batch
        self._batch_rows = 0.0  # recent rows per batch

    def estimate_s(self, rows: int) -> float | None:
        """Estimated CPU seconds to route `rows` rows; None before the first batch."""
        if self._batch_s is None:
            return None
        return self._batch_s * max(1.0, rows / max(1.0, self._batch_rows))

    def inline(self, rows: int) -> bool:
        """Whether a batch of `rows` rows would be routed on the calling thread."""
        estimate = self.estimate_s(rows)
        return self._inline_s > 0 and estimate is not None and estimate <= self._inline_s

    async def __call__(self, x: torch.Tensor, options: Hashable) -> Any:
        if self.inline(int(x.shape[0])):
            return self._timed(x, options)
        return await asyncio.to_thread(self._timed, x, options)

    def _timed(self, x: torch.Tensor, options: Hashable) -> Any:
        start = self._cpu_clock.now()
        routing = self._route(x, options)
        spent = self._cpu_clock.now() - start
        rows = float(x.shape[0])
        if self._batch_s is None:
            self._batch_s, self._batch_rows = spent, rows
        else:
            self._batch_s += _SMOOTHING * (spent - self._batch_s)
            self._batch_rows += _SMOOTHING * (rows - self._batch_rows)
        return routing
