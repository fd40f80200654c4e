"""A momlp app under real uvicorn on loopback, configured as `momlp serve` runs it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from server._connections import guarded_protocol
from server._runner import uvicorn_config
from server._settings import Settings
from server.http import client_gone

__all__ = ["serving", "serving_on_loopback"]


@asynccontextmanager
async def serving_on_loopback(app: Any, **settings: Any) -> AsyncIterator[str]:
    """uvicorn serving `app` (its lifespan included) on 127.0.0.1; yields the base URL.

    `settings` are the connection settings `uvicorn_config` reads (header_timeout_s, ...);
    the app's own come from the settings it was created with."""
    server = uvicorn.Server(uvicorn_config(app, Settings(host="127.0.0.1", port=0, **settings)))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()  # a failed start raises here
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def serving(
    app: Any, base: type[asyncio.Protocol] | None = None, **settings: Any
) -> AsyncIterator[int]:
    """uvicorn serving `app` as `momlp serve` configures it; yields the port. `base`: the
    HTTP/1.1 protocol to build on instead of the one uvicorn picks (httptools or h11)."""
    chosen = Settings(host="127.0.0.1", port=0, **settings)
    config = uvicorn_config(app, chosen)
    if base is not None:
        # As `momlp serve`'s (server._runner's `_guarded_protocol`), on the base named.
        config.http = guarded_protocol(
            header_timeout_s=chosen.header_timeout_s,
            max_connections=settings.get("max_connections", 4096),
            on_lost=client_gone,
            base=base,
        )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task
