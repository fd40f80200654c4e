"""Python SDK of a momlp server (sync and asyncio) and the `momlp loadtest` library.

Imports only httpx, pydantic and the standard library: works where torch and ray are absent;
numpy (binary bodies, `.numpy()`) and matplotlib (load-test plots) are used when installed.
"""

from __future__ import annotations

from ._async_client import AsyncClient
from ._base import DEFAULT_BASE_URL
from ._client import Client
from ._compare import write_comparison
from ._exceptions import (
    ClientClosed,
    ConnectError,
    ConnectTimeout,
    DecodingError,
    ExpertUnavailable,
    HTTPStatusError,
    InputError,
    InvalidInput,
    LoadTestConfigError,
    MomlpError,
    NetworkError,
    NotFound,
    PayloadTooLarge,
    ProtocolError,
    RateLimited,
    ServerError,
    ServiceUnavailable,
    TimeoutError,
    TransportError,
    Unauthorized,
)
from ._loadtest import arun_loadtest, run_loadtest
from ._loadtest_config import LoadTestConfig
from ._models import (
    ActorInfo,
    ExpertInfo,
    ExpertPatches,
    ExpertsInfo,
    ExpertStat,
    GeneratedExpert,
    GraphInfo,
    GraphNode,
    GraphStats,
    ModelInfo,
    Prediction,
    PredictStats,
    Routing,
)
from ._report import LoadTestReport, RequestRecord
from ._runner import Clock, MonotonicClock
from ._workload import Distribution, Workload, build_workload, expert_law

__all__ = [
    "DEFAULT_BASE_URL",
    "ActorInfo",
    "AsyncClient",
    "Client",
    "ClientClosed",
    "Clock",
    "ConnectError",
    "ConnectTimeout",
    "DecodingError",
    "Distribution",
    "ExpertInfo",
    "ExpertPatches",
    "ExpertStat",
    "ExpertUnavailable",
    "ExpertsInfo",
    "GeneratedExpert",
    "GraphInfo",
    "GraphNode",
    "GraphStats",
    "HTTPStatusError",
    "InputError",
    "InvalidInput",
    "LoadTestConfig",
    "LoadTestConfigError",
    "LoadTestReport",
    "ModelInfo",
    "MomlpError",
    "MonotonicClock",
    "NetworkError",
    "NotFound",
    "PayloadTooLarge",
    "PredictStats",
    "Prediction",
    "ProtocolError",
    "RateLimited",
    "RequestRecord",
    "Routing",
    "ServerError",
    "ServiceUnavailable",
    "TimeoutError",
    "TransportError",
    "Unauthorized",
    "Workload",
    "arun_loadtest",
    "build_workload",
    "expert_law",
    "run_loadtest",
    "write_comparison",
]
