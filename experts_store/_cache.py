"""ExpertCache: a byte-budget LRU of loaded experts with leases (pure Python + torch-free).

Invariant: resident bytes + bytes reserved for loads in flight <= budget, always. A leased
expert is never evicted. The loader runs outside the lock, so one slow load does not stall
hits on other experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

from experts_store._exceptions import CacheBusy, ExpertTooLarge

__all__ = ["CacheStats", "Clock", "ExpertCache", "ExpertLoader", "Lease", "MonotonicClock"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class ExpertLoader(Protocol[T_co]):
    def nbytes(self, expert_id: int) -> int: ...

    def load(self, expert_id: int) -> T_co: ...


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    loads: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0


@dataclass(frozen=True)
class Lease(Generic[T]):
    """A held expert: ``value`` stays resident until the lease's ``with`` block ends."""

    expert_id: int
    value: T
    hit: bool
    load_seconds: float
    nbytes: int


class _Entry(Generic[T]):
    __slots__ = ("error", "leases", "loading", "nbytes", "value", "waiters")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.loading = True
        self.value: T | None = None
        self.error: BaseException | None = None
        self.leases = 0
        self.waiters = 0

    @property
    def pinned(self) -> bool:
        return self.loading or self.leases > 0 or self.waiters > 0


class ExpertCache(Generic[T]):
    """Thread-safe byte-budget LRU; see the module docstring for the guarantees."""

    def __init__(
        self,
        budget_bytes: int,
        loader: ExpertLoader[T],
        *,
        clock: Clock | None = None,
        max_entry_bytes: int | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._budget = budget_bytes
        self._loader = loader
        self._clock = clock or MonotonicClock()
        self._max_entry = (
            budget_bytes if max_entry_bytes is None else min(max_entry_bytes, budget_bytes)
        )
        self._cond = threading.Condition()
        # Insertion order is recency order: the first unpinned resident entry is the LRU victim.
        self._entries: OrderedDict[int, _Entry[T]] = OrderedDict()
        self._resident = 0
        self._reserved = 0
        self._stats = CacheStats()
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

    def resident(self) -> dict[int, int]:
        """expert_id -> bytes of every loaded expert, least recently used first."""
        with self._cond:
            return {i: e.nbytes for i, e in self._entries.items() if not e.loading}

    def leased(self) -> dict[int, int]:
        """expert_id -> number of leases held now."""
        with self._cond:
            return {i: e.leases for i, e in self._entries.items() if e.leases}

    @contextlib.contextmanager
    def lease(self, expert_id: int, *, timeout: float | None = 30.0) -> Iterator[Lease[T]]:
        """Hold ``expert_id`` loaded for the ``with`` block, loading it on a miss.

        Raises ExpertTooLarge when it can never fit, CacheBusy when no room frees up within
        ``timeout`` seconds, and whatever the loader raised when the load fails (every
        caller waiting on that load gets the same error).
        """
        held, entry = self._acquire(expert_id, timeout)
        try:
            yield held
        finally:
            with self._cond:
                entry.leases -= 1
                self._cond.notify_all()

    def prefetch(self, expert_id: int) -> bool:
        """Load ``expert_id`` now if room can be made without waiting or evicting a leased
        expert. True when it is resident (or being loaded) afterwards."""
        nbytes = self._loader.nbytes(expert_id)
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is not None:
                return True
            if nbytes > self._max_entry or not self._make_room(nbytes):
                return False
            entry = self._reserve(expert_id, nbytes)
        try:
            self._load(expert_id, entry, leases=0)
        except Exception:
            logger.warning("prefetch of expert %s failed", expert_id, exc_info=True)
            return False
        return True

    def evict(self, expert_id: int) -> bool:
        """Drop ``expert_id`` if it is resident and not in use."""
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is None or entry.pinned:
                return False
            self._drop(expert_id, entry)
            self._cond.notify_all()
            return True

    def clear(self) -> None:
        """Drop every expert not in use."""
        with self._cond:
            for expert_id, entry in list(self._entries.items()):
                if not entry.pinned:
                    self._drop(expert_id, entry)
            self._cond.notify_all()

    def _acquire(self, expert_id: int, timeout: float | None) -> tuple[Lease[T], _Entry[T]]:
        start = self._clock.now()
        deadline = None if timeout is None else start + timeout
        missed = False
        nbytes: int | None = None
        while True:
            with self._cond:
                entry = self._entries.get(expert_id)
                if entry is not None and not entry.loading:
                    entry.leases += 1
                    self._entries.move_to_end(expert_id)
                    if not missed:
                        self._stats.hits += 1
                    waited = self._clock.now() - start if missed else 0.0
                    value = cast(T, entry.value)
                    return Lease(expert_id, value, not missed, waited, entry.nbytes), entry
                if entry is not None:
                    # Someone else is loading it: wait for that load instead of loading twice.
                    if not missed:
                        missed = True
                        self._stats.misses += 1
                    entry.waiters += 1
                    try:
                        while entry.loading:
                            if not self._wait(deadline):
                                raise CacheBusy(expert_id=expert_id, timeout=timeout)
                    finally:
                        entry.waiters -= 1
                    if entry.error is not None:
                        raise entry.error
                    continue
                if nbytes is not None:
                    if nbytes > self._max_entry:
                        raise ExpertTooLarge(
                            expert_id=expert_id, nbytes=nbytes, budget_bytes=self._max_entry
                        )
                    if self._make_room(nbytes):
                        if not missed:
                            self._stats.misses += 1
                        entry = self._reserve(expert_id, nbytes)
                        break
                    if not self._wait(deadline):
                        raise CacheBusy(expert_id=expert_id, timeout=timeout)
                    continue
            # Asked outside the lock: a loader may consult a file or a manifest.
            nbytes = self._loader.nbytes(expert_id)
        seconds = self._load(expert_id, entry, leases=1)
        return Lease(expert_id, cast(T, entry.value), False, seconds, nbytes), entry

    def _load(self, expert_id: int, entry: _Entry[T], *, leases: int) -> float:
        started = self._clock.now()
        try:
            value = self._loader.load(expert_id)
        except BaseException as exc:
            with self._cond:
                entry.error = exc
                entry.loading = False
                self._reserved -= entry.nbytes
                del self._entries[expert_id]
                self._cond.notify_all()
            raise
        seconds = self._clock.now() - started
        with self._cond:
            entry.value = value
            entry.loading = False
            entry.leases += leases
            self._reserved -= entry.nbytes
            self._resident += entry.nbytes
            self._entries.move_to_end(expert_id)
            self._stats.loads += 1
            self._stats.bytes_loaded += entry.nbytes
            self._stats.load_seconds += seconds
            self._cond.notify_all()
        logger.debug("loaded expert %s (%s bytes) in %.4f s", expert_id, entry.nbytes, seconds)
        return seconds

    def _reserve(self, expert_id: int, nbytes: int) -> _Entry[T]:
        entry: _Entry[T] = _Entry(nbytes)
        self._entries[expert_id] = entry
        self._reserved += nbytes
        return entry

    def _make_room(self, nbytes: int) -> bool:
        """Evict unpinned LRU experts until ``nbytes`` fit; evict nothing if they cannot."""
        free = self._budget - self._resident - self._reserved
        if nbytes <= free:
            return True
        evictable = sum(e.nbytes for e in self._entries.values() if not e.pinned)
        if free + evictable < nbytes:
            return False
        for expert_id, entry in list(self._entries.items()):
            if free >= nbytes:
                break
            if not entry.pinned:
                self._drop(expert_id, entry)
                free += entry.nbytes
        return True

    def _drop(self, expert_id: int, entry: _Entry[T]) -> None:
        del self._entries[expert_id]
        self._resident -= entry.nbytes
        self._stats.evictions += 1
        logger.debug("evicted expert %s (%s bytes)", expert_id, entry.nbytes)

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
