"""Sizes the tinylfu window by hill climbing on the observed hit rate (Caffeine's method).

A small window suits traffic whose popularity is stable (frequency decides); a large one suits
bursty traffic, where an expert is asked for many times in a short while and then not at all
(recency decides). Neither is known in advance, so the window's share of the budget moves by a
step every sample of requests: on in the same direction while the hit rate improves, back when
it drops. Steps shrink as the climb settles and grow again when the hit rate jumps (the traffic
changed).
"""

from __future__ import annotations

__all__ = ["WindowClimber"]


class WindowClimber:
    """The window's byte target; call `observe` with running hit and miss totals."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        initial_fraction: float = 0.01,
        step_fraction: float = 0.0625,
        decay: float = 0.98,
        restart_delta: float = 0.05,
        sample_per_entry: int = 10,
        minimum_sample: int = 100,
    ) -> None:
        self._budget = budget_bytes
        self._window = float(budget_bytes * initial_fraction)
        self._initial_step = budget_bytes * step_fraction
        self._step = self._initial_step
        self._decay = decay
        self._restart = restart_delta
        self._per_entry = sample_per_entry
        self._minimum = minimum_sample
        self._last_total = 0
        self._last_hits = 0
        self._last_rate: float | None = None

    @property
    def window_bytes(self) -> int:
        return int(self._window)

    def observe(self, *, hits: int, misses: int, entries: int) -> None:
        """Running totals of the cache; adjusts the window once a whole sample has passed."""
        total = hits + misses
        sample = total - self._last_total
        if sample < max(self._minimum, self._per_entry * entries):
            return
        rate = (hits - self._last_hits) / sample
        self._last_total, self._last_hits = total, hits
        previous, self._last_rate = self._last_rate, rate
        if previous is None:
            return
        delta = rate - previous
        amount = self._step if delta >= 0 else -self._step
        if abs(delta) >= self._restart:
            self._step = self._initial_step if amount > 0 else -self._initial_step
        else:
            self._step = self._decay * amount
        self._window = min(float(self._budget), max(0.0, self._window + amount))
