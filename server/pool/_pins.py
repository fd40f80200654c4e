"""The hypernetworks an actor generates with, held pinned in its expert cache.

Each f is leased once and the lease held, so it is counted in the budget and never evicted.
Key: f's sha256, least recently used first; past MAX_PINNED the oldest is released (an older
store version's f after hot swaps), and the cache may then evict it like any expert.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import AbstractContextManager
from typing import Any

from experts_store import ExpertCache, ExpertLoadError, FrozenHyperNetwork, GeneratorRef
from server.pool._loader import Cached, DeviceLoader

__all__ = ["MAX_PINNED", "GeneratorPins"]

# Hypernetworks held pinned per actor: the served store version's and the one before it.
MAX_PINNED = 2


class GeneratorPins:
    """The hypernetworks pinned in one actor's cache (`ActorCore`); thread-safe."""

    def __init__(
        self, cache: ExpertCache[Cached], loader: DeviceLoader, lease_timeout_s: float
    ) -> None:
        self._cache = cache
        self._loader = loader
        self._lease_timeout_s = lease_timeout_s
        self._pinned: OrderedDict[str, AbstractContextManager[Any]] = OrderedDict()
        self._pin_lock = threading.Lock()

    def pinned(self) -> list[str]:
        """The sha256 of each hypernetwork pinned now, least recently used first."""
        with self._pin_lock:
            return list(self._pinned)

    def pin(self, generator: GeneratorRef) -> None:
        """Load f once and keep it leased while it is in use (CacheError, StoreError)."""
        with self._pin_lock:
            if generator.sha256 in self._pinned:
                self._pinned.move_to_end(generator.sha256)
                return
            while len(self._pinned) >= MAX_PINNED:
                # The cache may now evict it like any expert; a generation racing this falls
                # back to reading the file (see DeviceLoader._generate).
                sha, old = self._pinned.popitem(last=False)
                self._loader.generators.pop(sha, None)
                old.__exit__(None, None, None)
            manager = self._cache.lease(generator, timeout=self._lease_timeout_s)
            lease = manager.__enter__()
            if not isinstance(lease.value, FrozenHyperNetwork):
                manager.__exit__(None, None, None)
                raise ExpertLoadError(expert_id=generator.expert_id, message="not a hypernetwork")
            self._loader.generators[generator.sha256] = lease.value
            self._pinned[generator.sha256] = manager

    def release(self) -> None:
        """Release every hypernetwork pinned now (a new store version went live)."""
        with self._pin_lock:
            while self._pinned:
                sha, manager = self._pinned.popitem(last=False)
                self._loader.generators.pop(sha, None)
                manager.__exit__(None, None, None)
