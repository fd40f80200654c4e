"""Operator endpoints: `POST /v1/admin/reload` swaps in the store published on disk now.

The swap is the one the store watcher does (`ServingState.swap`): it compares versions
first and answers at once when nothing changed; otherwise it opens the new store (data only,
no actor is touched) and makes it current, and requests already inside the old version finish
on it. The answer never waits past `request_timeout_s`: a swap still running then (a store
on a hung file system) is answered 504 and goes on in the background.

With an API key set, the key middleware guards this route like every other; without one,
only loopback clients may reload, so an open server cannot be made to reload by anyone who can
reach it. A request that a proxy relayed (it names the client in `Forwarded`,
`X-Forwarded-For` or `X-Real-IP`) is not from this machine, even when the proxy runs on it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
from pathlib import Path

from fastapi import FastAPI, Request
from pydantic import BaseModel

from server._exceptions import HttpError
from server.http._auth import bearer_key
from server.http._models import ErrorResponse
from server.serving import ServingState

__all__ = ["ReloadResponse", "add_admin_routes", "is_loopback"]

logger = logging.getLogger(__name__)

# Headers by which a proxy names the client it relays for. uvicorn takes X-Forwarded-For's
# client only from a proxy it trusts (FORWARDED_ALLOW_IPS, loopback by default) and reads
# neither of the others: behind a proxy on this machine that sets only `Forwarded` or
# `X-Real-IP` (nginx's common `proxy_set_header X-Real-IP $remote_addr`), every client
# anywhere looked like loopback.
_PROXY_HEADERS = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip"})


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


def _relayed(request: Request) -> bool:
    """True when a proxy relayed the request (it names the client it relays for)."""
    return any(name in _PROXY_HEADERS for name, _ in request.scope["headers"])


def add_admin_routes(app: FastAPI) -> None:
    @app.post(
        "/v1/admin/reload",
        response_model=ReloadResponse,
        responses={
            401: {"model": ErrorResponse, "description": "missing or wrong bearer key"},
            403: {
                "model": ErrorResponse,
                "description": "no key set, and not a loopback client or relayed by a proxy",
            },
            503: {"model": ErrorResponse, "description": "not ready, or the new store is broken"},
            504: {"model": ErrorResponse, "description": "the swap did not finish in time"},
        },
        summary="Reload the store from disk now (atomic swap; requests in flight finish)",
        description="Latency class: immediate when the store on disk is the version served "
        "(one read of manifest.json); otherwise the time to open the new manifest and router "
        "(no actor is created or restarted), typically milliseconds. Never longer than the "
        "server's request timeout: past it the answer is 504 and the swap goes on.",
    )
    async def reload(request: Request) -> ReloadResponse:
        serving: ServingState = request.app.state.serving
        client = request.client
        if bearer_key(serving.settings.api_key) is None and (
            not is_loopback(client.host if client else None) or _relayed(request)
        ):
            raise HttpError(
                403,
                "forbidden",
                # Loopback, not "this machine": a request to one of its other addresses comes
                # from that address, though it was sent here.
                "without an API key, the store can be reloaded only from loopback (127.0.0.1, "
                "::1), not through a proxy",
            )
        previous = serving.current().version
        timeout_s = serving.settings.request_timeout_s
        try:
            reloaded = await asyncio.wait_for(serving.swap(), timeout_s)
        except TimeoutError:
            raise HttpError(
                504,
                "timeout",
                f"the swap did not finish within {timeout_s:g} s; it goes on in the background",
                detail={"timeout_s": timeout_s, "store_version": previous},
            ) from None
        except Exception as exc:
            # The serving version is untouched: swap() installs only a fully opened one.
            logger.error("admin reload failed: %s", exc)
            raise HttpError(
                503,
                "reload_failed",
                "the store on disk could not be loaded; the previous version keeps serving",
                detail={
                    "reason": _store_named(str(exc), serving.settings.store),
                    "store_version": previous,
                },
            ) from exc
        current = serving.current().version
        return ReloadResponse(reloaded=reloaded, store_version=current, previous_version=previous)


def _store_named(text: str, store: Path) -> str:
    """`text` with the server's path to its store cut: files as the store names them, the
    folder itself as "the store" (the log keeps the full text)."""
    given = os.fspath(store)
    # The longer first (the absolute path holds the given one); a bare name such as "store"
    # is no path to hide, and replacing it would rewrite words of the message.
    roots = {os.path.abspath(store)} | ({given} if os.sep in given else set())
    for root in sorted(roots, key=len, reverse=True):
        root = root.rstrip(os.sep)
        text = text.replace(root + os.sep, "")
        # Only the folder itself: not a sibling whose name it begins (/srv/store-old).
        text = re.sub(re.escape(root) + r"(?![\w.-])", "the store", text)
    return text
