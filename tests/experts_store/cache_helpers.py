"""Fakes for the ExpertCache tests: a settable clock and a loader that counts and can stall."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["FakeClock", "FakeLoader", "wait_until"]


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


class FakeLoader:
    """Sizes from a dict; counts loads; optional gates and failures per expert."""

    def __init__(self, sizes: dict[int, int], clock: FakeClock | None = None) -> None:
        self.sizes = sizes
        self.clock = clock
        self.loads: dict[int, int] = {}
        self.gates: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        self.fail: set[int] = set()
        self.check: Callable[[], None] = lambda: None
        self._lock = threading.Lock()

    def nbytes(self, expert_id: int) -> int:
        return self.sizes[expert_id]

    def load(self, expert_id: int) -> str:
        with self._lock:
            self.loads[expert_id] = self.loads.get(expert_id, 0) + 1
        self.check()
        if expert_id in self.started:
            self.started[expert_id].set()
        if expert_id in self.gates:
            assert self.gates[expert_id].wait(10)
        if self.clock is not None:
            self.clock.t += 0.5
        if expert_id in self.fail:
            raise OSError(f"cannot read expert {expert_id}")
        return f"expert-{expert_id}"


def wait_until(predicate: Callable[[], bool]) -> None:
    """Wait for another thread to reach a state (bounded; not a timing assumption)."""
    event = threading.Event()
    for _ in range(2000):
        if predicate():
            return
        event.wait(0.005)
    raise AssertionError("condition never became true")
