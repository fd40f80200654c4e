"""The serving floor: store versions as data over one long-lived actor pool, and hot swap.

It sits on the batching and pool floors and knows nothing of HTTP.
"""

from __future__ import annotations

from server.serving._open import background_pacer
from server.serving._pool import ObservedPool, PoolFactory, ray_pool
from server.serving._state import ServingState, in_daemon_thread
from server.serving._version import (
    BatcherFactory,
    BatcherLike,
    StoreVersion,
    StoreVersionReader,
    default_batcher,
    read_store_version,
)

__all__ = [
    "BatcherFactory",
    "BatcherLike",
    "ObservedPool",
    "PoolFactory",
    "ServingState",
    "StoreVersion",
    "StoreVersionReader",
    "background_pacer",
    "default_batcher",
    "in_daemon_thread",
    "ray_pool",
    "read_store_version",
]
