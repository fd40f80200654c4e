"""Operator endpoints: `POST /v1/admin/reload` swaps in the store published on disk now.

The swap is the one the store watcher does (`ServingState.reload`): requests already inside
the old generation finish on it. With an API key set, the key middleware guards this route
like every other; without one, only loopback clients may reload, so an open server cannot be
made to rebuild its pool by anyone who can reach it.
"""

from __future__ import annotations

import ipaddress
import logging

from fastapi import FastAPI, Request
from pydantic import BaseModel

from server._generation import ServingState
from server._http_body import HttpError
from server._http_models import ErrorResponse

__all__ = ["ReloadResponse", "add_admin_routes", "is_loopback"]

logger = logging.getLogger(__name__)


class ReloadResponse(BaseModel):
    reloaded: bool  # False when the store on disk holds the version already served
    store_version: str
    previous_version: str


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8 and ::1 (and their IPv4-mapped form); False for anything else."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def add_admin_routes(app: FastAPI) -> None:
    @app.post(
        "/v1/admin/reload",
        response_model=ReloadResponse,
        responses={
            401: {"model": ErrorResponse, "description": "missing or wrong bearer key"},
            403: {"model": ErrorResponse, "description": "no key set and not a loopback client"},
            503: {"model": ErrorResponse, "description": "not ready, or the new store is broken"},
        },
        summary="Reload the store from disk now (atomic swap; requests in flight finish)",
    )
    async def reload(request: Request) -> ReloadResponse:
        serving: ServingState = request.app.state.serving
        client = request.client
        if serving.settings.api_key is None and not is_loopback(client.host if client else None):
            raise HttpError(
                403,
                "forbidden",
                "without an API key, the store can be reloaded only from this machine",
            )
        previous = serving.current().version
        try:
            reloaded = await serving.reload()
        except Exception as exc:
            # The serving generation is untouched: reload() swaps only a fully built one.
            logger.error("admin reload failed: %s", exc)
            raise HttpError(
                503,
                "reload_failed",
                "the store on disk could not be loaded; the previous version keeps serving",
                detail={"reason": str(exc), "store_version": previous},
            ) from exc
        current = serving.current().version
        return ReloadResponse(reloaded=reloaded, store_version=current, previous_version=previous)
