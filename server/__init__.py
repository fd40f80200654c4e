"""momlp's server: settings, the expert pool runtime, the FastAPI app and the `momlp` CLI.

Five floors, each importing only the ones below it: `server.pool` (Ray actors and their
content-keyed caches), `server.kinds` (each store kind's plan and combine), `server.batching`
(requests merged, routed and grouped by expert), `server.serving` (store versions as data over
one pool, hot swap) and `server.http` (the FastAPI app); the process runner and the CLI sit
on top.

Names are imported on first use: `momlp` (whose entry point lives in this package) must start
fast and must work for `momlp loadtest` where torch and ray are not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server._exceptions import (
        ActorFailed,
        CapExceeded,
        ExpertUnavailable,
        HttpError,
        InvalidRequest,
        NotReady,
        PoolClosed,
        PoolSaturated,
        PoolStartFailed,
        RequestTimeout,
        ServerError,
        StoreNotServable,
        UnknownStoreKind,
    )
    from server._runner import run_server
    from server._settings import Settings
    from server.batching import BatchAnswer, Batcher, ExpertStat
    from server.http import Metrics, create_app
    from server.pool import (
        ActorInfo,
        ExpertPool,
        FakeExpertPool,
        Group,
        GroupResult,
        RayExpertPool,
        ray_session,
    )

__all__ = [
    "ActorFailed",
    "ActorInfo",
    "BatchAnswer",
    "Batcher",
    "CapExceeded",
    "ExpertPool",
    "ExpertStat",
    "ExpertUnavailable",
    "FakeExpertPool",
    "Group",
    "GroupResult",
    "HttpError",
    "InvalidRequest",
    "Metrics",
    "NotReady",
    "PoolClosed",
    "PoolSaturated",
    "PoolStartFailed",
    "RayExpertPool",
    "RequestTimeout",
    "ServerError",
    "Settings",
    "StoreNotServable",
    "UnknownStoreKind",
    "create_app",
    "ray_session",
    "run_server",
]

_HOMES = {
    "create_app": "server.http",
    "Metrics": "server.http",
    **{name: "server.batching" for name in ("BatchAnswer", "Batcher", "ExpertStat")},
    **{
        name: "server.pool"
        for name in (
            "ActorInfo",
            "ExpertPool",
            "FakeExpertPool",
            "Group",
            "GroupResult",
            "RayExpertPool",
            "ray_session",
        )
    },
    "run_server": "server._runner",
    "Settings": "server._settings",
    **{
        name: "server._exceptions"
        for name in (
            "ActorFailed",
            "CapExceeded",
            "ExpertUnavailable",
            "HttpError",
            "InvalidRequest",
            "NotReady",
            "PoolClosed",
            "PoolSaturated",
            "PoolStartFailed",
            "RequestTimeout",
            "ServerError",
            "StoreNotServable",
            "UnknownStoreKind",
        )
    },
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'server' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
