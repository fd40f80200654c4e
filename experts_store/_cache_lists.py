"""The two recency lists an `ExpertCache` keeps its experts in, their byte accounts under
one budget, and the choice of victims that makes room (lru, or W-TinyLFU's window and
admission contest: the policies are told in `_cache`'s docstring).

Not thread-safe: `ExpertCache` subclasses `CacheLists` and calls these methods holding its
lock; a base class rather than a member, so that a lease's calls here cost no more than
the cache's own methods.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator
from typing import Generic, TypeVar

from experts_store._cache_types import CacheStats
from experts_store._frequency import Admission

__all__ = ["CacheEntry", "CacheLists"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CacheEntry(Generic[T]):
    """One expert in the lists: loading or loaded, and who holds it (pinned while any does)."""

    __slots__ = ("admitted", "awaited", "error", "leases", "loading", "nbytes", "value", "waiters")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.admitted = False  # False: in the window (or the only list, under lru)
        self.awaited = False  # tinylfu: prefetched for a queued request, not leased yet
        self.loading = True
        self.value: T | None = None
        self.error: BaseException | None = None
        self.leases = 0
        self.waiters = 0

    @property
    def pinned(self) -> bool:
        return self.loading or self.leases > 0 or self.waiters > 0


class CacheLists(Generic[T]):
    """Experts in a window and (tinylfu) an admitted list, least recently used first, with
    the bytes resident and reserved for loads in flight; see the module docstring."""

    def __init__(self, budget_bytes: int, admission: Admission | None) -> None:
        self._budget = budget_bytes
        # Under lru (no admission) the window is the whole cache and nothing is ever admitted
        # past it.
        self._admission = admission
        # The window also keeps room for the largest expert seen, so that a newcomer always
        # lands there and never pushes an admitted expert out without a contest.
        self._largest = 0
        # Insertion order is recency order, oldest first, in both lists.
        self._window: OrderedDict[Hashable, CacheEntry[T]] = OrderedDict()
        self._main: OrderedDict[Hashable, CacheEntry[T]] = OrderedDict()
        self._window_bytes = 0  # resident and reserved
        self._main_bytes = 0
        self._resident = 0
        self._reserved = 0
        self._stats = CacheStats()

    def _get(self, key: Hashable) -> CacheEntry[T] | None:
        entry = self._window.get(key)
        return entry if entry is not None else self._main.get(key)

    def _ordered(self) -> Iterator[tuple[Hashable, CacheEntry[T]]]:
        """Every entry in the order victims are considered (window, then admitted)."""
        yield from list(self._window.items())
        yield from list(self._main.items())

    def _touch(self, key: Hashable, entry: CacheEntry[T]) -> None:
        (self._main if entry.admitted else self._window).move_to_end(key)

    def _unlink(self, key: Hashable, entry: CacheEntry[T]) -> None:
        if entry.admitted:
            del self._main[key]
            self._main_bytes -= entry.nbytes
        else:
            del self._window[key]
            self._window_bytes -= entry.nbytes

    def _reserve(self, key: Hashable, nbytes: int) -> CacheEntry[T]:
        self._largest = max(self._largest, nbytes)
        entry: CacheEntry[T] = CacheEntry(nbytes)
        self._window[key] = entry
        self._window_bytes += nbytes
        self._reserved += nbytes
        return entry

    def _make_room(self, nbytes: int, keep: Collection[Hashable] = ()) -> bool:
        """Evict until ``nbytes`` fit; evict nothing if they cannot (leased and ``keep``
        experts are never evicted)."""
        free = self._budget - self._resident - self._reserved
        if nbytes <= free:
            return True

        def movable(item: tuple[Hashable, CacheEntry[T]]) -> bool:
            return not item[1].pinned and item[0] not in keep

        # Can enough be evicted? Stops at the first movable experts that cover the shortfall
        # (usually the first one or two) instead of summing the whole cache on every miss.
        short = nbytes - free
        for item in itertools.chain(self._window.items(), self._main.items()):
            if movable(item):
                short -= item[1].nbytes
                if short <= 0:
                    break
        else:
            return False
        admission = self._admission
        floor = self._budget if admission is None else admission.climber.window_bytes
        window_target = max(floor, self._largest, nbytes)
        main_target = self._budget - window_target
        while free < nbytes:
            candidate = next(filter(movable, self._window.items()), None)
            victim = next(filter(movable, self._main.items()), None)
            window_full = self._window_bytes + nbytes > window_target
            if candidate is not None and (victim is None or window_full):
                free += self._settle(*candidate, victim, main_target)
            else:
                assert victim is not None  # the scan above found enough movable bytes
                free += self._drop(*victim)
        return True

    def _settle(
        self,
        key: Hashable,
        entry: CacheEntry[T],
        victim: tuple[Hashable, CacheEntry[T]] | None,
        main_target: int,
    ) -> int:
        """The window's oldest expert leaves it: admitted if there is room, else it contests
        ``victim`` and the loser is dropped. Returns the bytes freed."""
        if self._main_bytes + entry.nbytes <= main_target:
            self._admit(key, entry)
            return 0
        # A prefetched expert's request is queued but not counted yet: it wins, or it would be
        # dropped just before the request that wants it.
        admission = self._admission
        if victim is not None and (
            entry.awaited or (admission is not None and admission.admits(key, victim[0]))
        ):
            freed = self._drop(*victim)
            # The winner takes the room now: left in the window, it would queue behind
            # younger newcomers for the next free place.
            if self._main_bytes + entry.nbytes <= main_target:
                self._admit(key, entry)
            return freed
        if self._admission is not None:
            self._stats.rejections += 1
        return self._drop(key, entry)

    def _admit(self, key: Hashable, entry: CacheEntry[T]) -> None:
        self._unlink(key, entry)
        entry.admitted = True
        self._main[key] = entry
        self._main_bytes += entry.nbytes

    def _drop(self, key: Hashable, entry: CacheEntry[T]) -> int:
        self._unlink(key, entry)
        self._resident -= entry.nbytes
        self._stats.evictions += 1
        logger.debug("evicted expert %s (%s bytes)", key, entry.nbytes)
        return entry.nbytes
