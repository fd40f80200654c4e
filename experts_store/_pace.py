"""Pacing: a long Python loop run beside a serving event loop hands the GIL over often.

A thread that runs Python without a system call keeps the GIL until the interpreter's switch
interval (5 ms) forces it out, and every other thread then waits up to that long after each
of its own system calls. Opening a K=100,000 store version on a daemon thread is ~3 s of such
Python, and under load it stalled requests for up to 1.6-3.1 s (benchmarks/RESULTS.md,
fifty-second and fifty-third sessions). Its loops call a `Pace` once per item; a `Pacer`
sleeps briefly after each slice of work, so the event loop waits at most one slice for the
GIL, and the open takes (work + rest) / work as long.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Pace", "Pacer", "no_pace"]

Pace = Callable[[], None]


def no_pace() -> None:
    """The pace of a loop nobody waits beside (a CLI, a server's start): none."""


class Pacer:
    """A `Pace` that sleeps `rest_s` once `work_s` of work has passed since the last rest."""

    def __init__(
        self,
        work_s: float,
        rest_s: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if work_s <= 0 or rest_s < 0:
            raise ValueError(f"a pacer needs work_s > 0 and rest_s >= 0, not {work_s}, {rest_s}")
        self.work_s = work_s
        self.rest_s = rest_s
        self._clock = clock
        self._sleep = sleep
        self._since = clock()
        self.rests = 0  # how many times it slept: what a test or a log can tell of it

    def __call__(self) -> None:
        if self._clock() - self._since >= self.work_s:
            self._sleep(self.rest_s)
            self.rests += 1
            self._since = self._clock()
