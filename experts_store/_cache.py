"""ExpertCache: a byte-budget cache of loaded experts with leases (pure Python, torch-free).

Invariant: resident bytes + bytes reserved for loads in flight <= budget, always. A leased
expert is never evicted. The loader runs outside the lock, so one slow load does not stall
hits on other experts.

Two policies, both choosing victims least recently used first:

- ``lru``: one recency list.
- ``tinylfu`` (W-TinyLFU): a new expert enters a *window* (at first ``window_fraction`` of the
  budget, then sized by `WindowClimber`; always room for the largest expert seen). When the
  window must give room, its oldest expert contests the least recently used *admitted* expert
  on recent popularity (`FrequencyCounter`); the less popular one is dropped. On skewed
  traffic this keeps the popular experts that plain LRU lets one-off requests flush out.

The lists, their byte accounts and the choice of victims are `CacheLists`' (`_cache_lists`);
this module adds the leases, the loads and the waits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Collection, Hashable, Iterator
from typing import TypeVar, cast

from experts_store._cache_lists import CacheEntry, CacheLists
from experts_store._cache_types import (
    CACHE_POLICIES,
    CachePolicy,
    CacheStats,
    Clock,
    ExpertLoader,
    Lease,
    MonotonicClock,
    key_label,
)
from experts_store._exceptions import CacheBusy, ExpertTooLarge
from experts_store._frequency import Admission

__all__ = ["ExpertCache"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ExpertCache(CacheLists[T]):
    """Thread-safe byte-budget cache; see the module docstring for the guarantees."""

    def __init__(
        self,
        budget_bytes: int,
        loader: ExpertLoader[T],
        *,
        clock: Clock | None = None,
        max_entry_bytes: int | None = None,
        policy: CachePolicy = "lru",
        window_fraction: float = 0.01,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if policy not in CACHE_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(CACHE_POLICIES)}, got {policy!r}")
        if not 0.0 <= window_fraction <= 1.0:
            raise ValueError(f"window_fraction must be in [0, 1], got {window_fraction}")
        # Under lru (no admission) the window is the whole cache (`CacheLists`).
        admission: Admission | None = None
        if policy == "tinylfu":
            admission = Admission(budget_bytes, window_fraction=window_fraction)
        super().__init__(budget_bytes, admission)
        self._loader = loader
        self._clock = clock or MonotonicClock()
        self._max_entry = (
            budget_bytes if max_entry_bytes is None else min(max_entry_bytes, budget_bytes)
        )
        self.policy = policy
        self._cond = threading.Condition()
        self._waiting = 0

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def resident_bytes(self) -> int:
        with self._cond:
            return self._resident

    @property
    def reserved_bytes(self) -> int:
        with self._cond:
            return self._reserved

    @property
    def used_bytes(self) -> int:
        """resident_bytes + reserved_bytes, read atomically (never above budget_bytes)."""
        with self._cond:
            return self._resident + self._reserved

    @property
    def stats(self) -> CacheStats:
        with self._cond:
            return dataclasses.replace(self._stats)

    @property
    def waiting(self) -> int:
        """Leases blocked now, waiting for room or for another caller's load."""
        with self._cond:
            return self._waiting

    def resident(self) -> dict[Hashable, int]:
        """key -> bytes of every loaded expert, in the order victims are considered:
        the window oldest first, then admitted experts least recently used first."""
        with self._cond:
            return {i: e.nbytes for i, e in self._ordered() if not e.loading}

    def leased(self) -> dict[Hashable, int]:
        """key -> number of leases held now."""
        with self._cond:
            return {i: e.leases for i, e in self._ordered() if e.leases}

    @contextlib.contextmanager
    def lease(self, key: Hashable, *, timeout: float | None = 30.0) -> Iterator[Lease[T]]:
        """Hold ``key`` loaded for the ``with`` block, loading it on a miss.

        Raises ExpertTooLarge when it can never fit, CacheBusy when no room frees up within
        ``timeout`` seconds, and whatever the loader raised when the load fails (every
        caller waiting on that load gets the same error).
        """
        held, entry = self._acquire(key, timeout)
        try:
            yield held
        finally:
            with self._cond:
                entry.leases -= 1
                self._cond.notify_all()

    def prefetch(self, key: Hashable, *, keep: Collection[Hashable] = ()) -> bool:
        """Load ``key`` now if room can be made without waiting, without evicting a
        leased expert and without evicting one in ``keep`` (experts soon needed). True when
        it is resident (or being loaded) afterwards."""
        nbytes = self._loader.nbytes(key)
        with self._cond:
            if self._get(key) is not None:
                return True
            if nbytes > self._max_entry or not self._make_room(nbytes, keep):
                return False
            entry = self._reserve(key, nbytes)
            entry.awaited = self._admission is not None
        try:
            self._load(key, entry, leases=0)
        except Exception:
            logger.warning("prefetch of expert %s failed", key, exc_info=True)
            return False
        return True

    def evict(self, key: Hashable) -> bool:
        """Drop ``key`` if it is resident and not in use."""
        with self._cond:
            entry = self._get(key)
            if entry is None or entry.pinned:
                return False
            self._drop(key, entry)
            self._cond.notify_all()
            return True

    def forget_popularity(self) -> None:
        """Count popularity afresh, keeping every expert resident (tinylfu; lru has none).

        For a new store version: the experts it dropped are never asked for again, but their
        old counts would let them win every admission contest against its new experts until
        aging wore them down (thousands of requests). Without counts they are the first to go;
        the unchanged experts that are still asked for earn theirs back at once.
        """
        with self._cond:
            if self._admission is not None:
                self._admission.frequency.clear()

    def clear(self) -> None:
        """Drop every expert not in use."""
        with self._cond:
            for key, entry in list(self._ordered()):
                if not entry.pinned:
                    self._drop(key, entry)
            self._cond.notify_all()

    def _acquire(self, key: Hashable, timeout: float | None) -> tuple[Lease[T], CacheEntry[T]]:
        start = self._clock.now()
        deadline = None if timeout is None else start + timeout
        missed = False
        nbytes: int | None = None
        counted = self._admission is None
        while True:
            with self._cond:
                if not counted and self._admission is not None:
                    counted = True
                    self._admission.record(
                        key,
                        hits=self._stats.hits,
                        misses=self._stats.misses,
                        entries=len(self._window) + len(self._main),
                    )
                entry = self._get(key)
                if entry is not None and not entry.loading:
                    entry.leases += 1
                    entry.awaited = False
                    self._touch(key, entry)
                    if not missed:
                        self._stats.hits += 1
                    waited = self._clock.now() - start if missed else 0.0
                    value = cast(T, entry.value)
                    return Lease(key, value, not missed, waited, entry.nbytes), entry
                if entry is not None:
                    # Someone else is loading it: wait for that load instead of loading twice.
                    if not missed:
                        missed = True
                        self._stats.misses += 1
                    entry.waiters += 1
                    try:
                        while entry.loading:
                            # A deadline that passes as the load ends takes its outcome: its
                            # error is this waiter's to clear (see `_load`).
                            if not self._wait(deadline) and entry.loading:
                                raise CacheBusy(expert_id=key_label(key), timeout=timeout)
                    finally:
                        entry.waiters -= 1
                    if entry.error is not None:
                        try:
                            raise entry.error
                        finally:
                            if not entry.waiters:  # the last caller to take it (see _load)
                                entry.error = None
                    continue
                if nbytes is not None:
                    if nbytes > self._max_entry:
                        raise ExpertTooLarge(
                            expert_id=key_label(key), nbytes=nbytes, budget_bytes=self._max_entry
                        )
                    if self._make_room(nbytes):
                        if not missed:
                            self._stats.misses += 1
                        entry = self._reserve(key, nbytes)
                        break
                    if not self._wait(deadline):
                        raise CacheBusy(expert_id=key_label(key), timeout=timeout)
                    continue
            # Asked outside the lock: a loader may consult a file or a manifest.
            nbytes = self._loader.nbytes(key)
        seconds = self._load(key, entry, leases=1)
        return Lease(key, cast(T, entry.value), False, seconds, nbytes), entry

    def _load(self, key: Hashable, entry: CacheEntry[T], *, leases: int) -> float:
        started = self._clock.now()
        try:
            value = self._loader.load(key)
        except BaseException as exc:
            with self._cond:
                # Kept for the callers waiting on this load only, and dropped by the last of
                # them: the error's traceback holds this frame, hence `entry`, so a kept error
                # is a cycle that held what the failed load had allocated (on a GPU its device
                # copy, outside the budget) until the next full garbage collection.
                entry.error = exc if entry.waiters else None
                entry.loading = False
                self._reserved -= entry.nbytes
                self._unlink(key, entry)
                self._cond.notify_all()
            raise
        seconds = self._clock.now() - started
        with self._cond:
            entry.value = value
            entry.loading = False
            entry.leases += leases
            self._reserved -= entry.nbytes
            self._resident += entry.nbytes
            self._touch(key, entry)
            self._stats.loads += 1
            self._stats.bytes_loaded += entry.nbytes
            self._stats.load_seconds += seconds
            self._cond.notify_all()
        logger.debug("loaded expert %s (%s bytes) in %.4f s", key, entry.nbytes, seconds)
        return seconds
    def _wait(self, deadline: float | None) -> bool:
        """Wait for a change; False once the deadline has passed (checked on the clock)."""
        remaining = None if deadline is None else deadline - self._clock.now()
        if remaining is not None and remaining <= 0:
            return False
        self._waiting += 1
        try:
            # Real time is the backstop: a clock that never advances cannot wait forever.
            return self._cond.wait(remaining) or deadline is None
        finally:
            self._waiting -= 1
