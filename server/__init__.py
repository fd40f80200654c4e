"""momlp's server: settings, the expert pool runtime, the FastAPI app and the `momlp` CLI.

Names are imported on first use: `momlp` (whose entry point lives in this package) must start
fast and must work for `momlp loadtest` where torch and ray are not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server._app import create_app
    from server._batcher import Batcher
    from server._exceptions import (
        ActorFailed,
        ExpertUnavailable,
        InvalidRequest,
        NotReady,
        PoolClosed,
        PoolSaturated,
        RequestTimeout,
        ServerError,
    )
    from server._fake_pool import FakeExpertPool
    from server._metrics import Metrics
    from server._ray_pool import RayExpertPool
    from server._runner import run_server
    from server._runtime_types import (
        ActorInfo,
        BatchAnswer,
        ExpertPool,
        ExpertStat,
        Group,
        GroupResult,
    )
    from server._settings import Settings

__all__ = [
    "ActorFailed",
    "ActorInfo",
    "BatchAnswer",
    "Batcher",
    "ExpertPool",
    "ExpertStat",
    "ExpertUnavailable",
    "FakeExpertPool",
    "Group",
    "GroupResult",
    "InvalidRequest",
    "Metrics",
    "NotReady",
    "PoolClosed",
    "PoolSaturated",
    "RayExpertPool",
    "RequestTimeout",
    "ServerError",
    "Settings",
    "create_app",
    "run_server",
]

_HOMES = {
    "create_app": "server._app",
    "Batcher": "server._batcher",
    "FakeExpertPool": "server._fake_pool",
    "RayExpertPool": "server._ray_pool",
    **{
        name: "server._runtime_types"
        for name in ("ActorInfo", "BatchAnswer", "ExpertPool", "ExpertStat", "Group", "GroupResult")
    },
    "Metrics": "server._metrics",
    "run_server": "server._runner",
    "Settings": "server._settings",
    **{
        name: "server._exceptions"
        for name in (
            "ActorFailed",
            "ExpertUnavailable",
            "InvalidRequest",
            "NotReady",
            "PoolClosed",
            "PoolSaturated",
            "RequestTimeout",
            "ServerError",
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
