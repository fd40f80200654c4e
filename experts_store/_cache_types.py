"""The ExpertCache's vocabulary: its loader and clock seams, its policies, leases and stats."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar, get_args

__all__ = [
    "CACHE_POLICIES",
    "CachePolicy",
    "CacheStats",
    "Clock",
    "ExpertLoader",
    "Lease",
    "MonotonicClock",
]

CachePolicy = Literal["lru", "tinylfu"]
CACHE_POLICIES: tuple[CachePolicy, ...] = get_args(CachePolicy)

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
    rejections: int = 0  # tinylfu: newcomers dropped for being less popular than the victim
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
