"""The ExpertCache's vocabulary: its loader and clock seams, its policies, leases and stats."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar, get_args

__all__ = [
    "CACHE_POLICIES",
    "CachePolicy",
    "CacheStats",
    "Clock",
    "ExpertLoader",
    "Lease",
    "MonotonicClock",
    "key_label",
]

CachePolicy = Literal["lru", "tinylfu"]
CACHE_POLICIES: tuple[CachePolicy, ...] = get_args(CachePolicy)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class ExpertLoader(Protocol[T_co]):
    """Sizes and loads what a cache key names. Keys are opaque to the cache: an expert id,
    an `ExpertRef` (content-addressed), or any other hashable a loader understands."""

    def nbytes(self, key: Any) -> int: ...

    def load(self, key: Any) -> T_co: ...


def key_label(key: Hashable) -> Any:
    """What errors name for a key: its expert id when it carries one, else the key itself."""
    return getattr(key, "expert_id", key)


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

    key: Hashable
    value: T
    hit: bool
    load_seconds: float
    nbytes: int
