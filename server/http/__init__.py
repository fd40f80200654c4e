"""The HTTP floor: the FastAPI app, its lifespan, body parsing, errors, auth and metrics.

It sits on the serving floor (`server.serving`) and is the only floor that knows HTTP.
"""

from __future__ import annotations

from server._exceptions import HttpError
from server.http._admin import ReloadResponse, is_loopback
from server.http._app import create_app, pool_snapshot
from server.http._auth import bearer_key
from server.http._deadline import client_gone
from server.http._errors import error_response
from server.http._metrics import CONTENT_TYPE, Metrics, PoolSnapshot
from server.http._request_id import RequestIdLogFilter

__all__ = [
    "CONTENT_TYPE",
    "HttpError",
    "Metrics",
    "PoolSnapshot",
    "ReloadResponse",
    "RequestIdLogFilter",
    "bearer_key",
    "client_gone",
    "create_app",
    "error_response",
    "is_loopback",
    "pool_snapshot",
]
