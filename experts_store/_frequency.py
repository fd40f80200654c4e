"""Recent-popularity counts for the cache's admission filter (TinyLFU's aging, exact counts).

A store holds thousands of experts, not millions of keys, so exact counts in a dict cost less
than a count-min sketch and never confuse two experts. Every `sample` accesses all counts are
halved, so an expert that stops being asked for loses its standing within a few samples.
"""

from __future__ import annotations

from collections.abc import Hashable

from experts_store._climber import WindowClimber

__all__ = ["Admission", "FrequencyCounter"]


class FrequencyCounter:
    """Counts accesses per expert; halves every count once `sample_size()` accesses were seen.

    The sample scales with the cache: `per_entry` accesses per resident expert (at least
    `minimum`), so a count is a share of the traffic the cache could have served, not of
    all traffic since start.
    """

    def __init__(self, *, per_entry: int = 50, minimum: int = 1000) -> None:
        if per_entry < 1 or minimum < 1:
            raise ValueError(f"per_entry and minimum must be >= 1, got {per_entry}, {minimum}")
        self._per_entry = per_entry
        self._minimum = minimum
        self._counts: dict[Hashable, int] = {}
        self._seen = 0
        self.halvings = 0

    def sample_size(self, entries: int) -> int:
        return max(self._minimum, self._per_entry * entries)

    def record(self, key: Hashable, *, entries: int) -> None:
        """One access to `key`, while `entries` experts are resident."""
        self._counts[key] = self._counts.get(key, 0) + 1
        self._seen += 1
        if self._seen >= self.sample_size(entries):
            self._halve()

    def estimate(self, key: Hashable) -> int:
        return self._counts.get(key, 0)

    def clear(self) -> None:
        """Forget every count: popularity starts again from the next access."""
        self._counts = {}
        self._seen = 0

    def _halve(self) -> None:
        # Odd counts round down, which drops the ones and keeps the dict small.
        self._counts = {k: v >> 1 for k, v in self._counts.items() if v > 1}
        self._seen = 0
        self.halvings += 1


class Admission:
    """The tinylfu policy's state: recent popularity, and the window's size."""

    def __init__(self, budget_bytes: int, *, window_fraction: float) -> None:
        # 20 accesses per cached expert between halvings, down to small caches: a floor of
        # 1,000 kept a 20-expert cache's counts for 50 accesses each, so it followed a shift
        # in popularity later than LRU (benchmarks/RESULTS.md, "The first GPU session").
        self.frequency = FrequencyCounter(per_entry=20, minimum=100)
        self.climber = WindowClimber(budget_bytes, initial_fraction=window_fraction)

    def record(self, key: Hashable, *, hits: int, misses: int, entries: int) -> None:
        """One lease asked for; `hits` and `misses` are the cache's totals before it."""
        self.frequency.record(key, entries=entries)
        self.climber.observe(hits=hits, misses=misses, entries=entries)

    def admits(self, candidate: Hashable, victim: Hashable) -> bool:
        # Ties keep the admitted expert: it has been useful for longer.
        return self.frequency.estimate(candidate) > self.frequency.estimate(victim)
