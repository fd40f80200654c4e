"""A set of the keys seen lately, of bounded size: what a long-running reader remembers of
the contents it has checked, without growing with every content it ever met."""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["RecentKeys"]


class RecentKeys:
    """Keys added lately, at most `2 * capacity` of them.

    Two generations: keys are added to the young one; once it holds `capacity` keys it
    becomes the old one and the previous old one is dropped. A key found in the old
    generation moves to the young one, so a key in use stays while keys not seen for
    `capacity` additions are forgotten. Not thread-safe: callers hold their own lock.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._young: set[Hashable] = set()
        self._old: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def __contains__(self, key: Hashable) -> bool:
        if key in self._young:
            return True
        if key in self._old:
            self.add(key)
            return True
        return False

    def add(self, key: Hashable) -> None:
        if key in self._young:
            return
        if len(self._young) >= self.capacity:
            self._old, self._young = self._young, set()
        self._young.add(key)
