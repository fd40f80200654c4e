"""Recent-popularity counts for the cache's admission filter (TinyLFU's aging, exact counts).

A store holds thousands of experts, not millions of keys, so exact counts in a dict cost less
than a count-min sketch and never confuse two experts. Every `sample` accesses all counts are
halved, so an expert that stops being asked for loses its standing within a few samples.
"""

from __future__ import annotations

__all__ = ["FrequencyCounter"]


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
        self._counts: dict[int, int] = {}
        self._seen = 0
        self.halvings = 0

    def sample_size(self, entries: int) -> int:
        return max(self._minimum, self._per_entry * entries)

    def record(self, key: int, *, entries: int) -> None:
        """One access to `key`, while `entries` experts are resident."""
        self._counts[key] = self._counts.get(key, 0) + 1
        self._seen += 1
        if self._seen >= self.sample_size(entries):
            self._halve()

    def estimate(self, key: int) -> int:
        return self._counts.get(key, 0)

    def _halve(self) -> None:
        # Odd counts round down, which drops the ones and keeps the dict small.
        self._counts = {k: v >> 1 for k, v in self._counts.items() if v > 1}
        self._seen = 0
        self.halvings += 1
