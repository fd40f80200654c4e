"""Run the app under uvicorn: Ray up first, the URL logged when ready, clean exit on a signal.

uvicorn's graceful shutdown lets in-flight requests finish (each is bounded by
`request_timeout_s`), then the lifespan closes the pool; Ray is shut down last, and only if
this process started (or connected) it (`server.pool.ray_session`). So a SIGTERM stops the
server within `request_timeout_s` plus a few seconds, whatever is in flight.
"""

from __future__ import annotations

import gc
import logging
import math
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from server._settings import Settings
from server.batching import OpenConnections

if TYPE_CHECKING:
    import uvicorn

__all__ = [
    "count_connections",
    "freeze_heap",
    "open_without_key",
    "run_server",
    "uvicorn_config",
]

logger = logging.getLogger(__name__)


def freeze_heap() -> int:
    """Collect garbage, then move every object still alive out of the cyclic GC's reach;
    returns how many objects are frozen.

    A started server holds a large heap that lives as long as it does (torch, Ray, the app,
    the first store version). Python's full collections traverse all of it: under load one
    came every few seconds and paused the event loop 140-170 ms, which is where the
    benchmark's occasional ~200 ms p99 came from; after a freeze they take 2-4 ms
    (benchmarks/RESULTS.md, "full collections"). What the first store version leaves behind
    in reference cycles when it is swapped out stays frozen: a bounded, one-time cost.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def open_without_key(settings: Settings) -> bool:
    """True when the server will answer beyond this machine with no API key asked for."""
    if settings.api_key:
        return False
    from server.http import is_loopback

    return not (settings.host == "localhost" or is_loopback(settings.host))


def _bound_url(server: Any, settings: Settings) -> str:
    for srv in getattr(server, "servers", []):
        for sock in getattr(srv, "sockets", []):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                host, port = sock.getsockname()[:2]
                if sock.family == socket.AF_INET6:
                    host = f"[{host}]"
                return f"http://{host}:{port}"
    return f"http://{settings.host}:{settings.port}"


def uvicorn_config(app: Any, settings: Settings) -> uvicorn.Config:
    """How `run_server` runs uvicorn: bound and logging as `settings` say."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=settings.access_log,
        lifespan="on",
        # Requests end by request_timeout_s on their own; past it, nothing is worth waiting for.
        timeout_graceful_shutdown=max(1, math.ceil(settings.request_timeout_s)),
    )


def count_connections(app: Any, server: uvicorn.Server) -> None:
    """Let a momlp app's batch windows see how many connections `server` holds open
    (`server.batching.OpenConnections`); other apps are left alone."""
    connections = getattr(getattr(app, "state", None), "connections", None)
    if isinstance(connections, OpenConnections):
        # uvicorn's own set of open connections, the one its limit_concurrency counts.
        connections.attach(lambda: len(server.server_state.connections))


def run_server(settings: Settings, *, app_factory: Callable[[Settings], Any] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; 0 after a clean shutdown, 1 if startup failed."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from server.http import create_app
    from server.pool import ray_session

    if open_without_key(settings):
        logger.warning(
            "serving on %s with no API key: anyone who can reach this port can call the "
            "model (only reloads stay limited to this machine); set MOMLP_API_KEY or pass "
            "--api-key-env VAR",
            settings.host,
        )
    with ray_session(address=settings.ray_address, num_cpus=settings.ray_num_cpus):
        app = (app_factory or create_app)(settings)

        class _Server(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                if self.started:
                    if settings.gc_freeze:
                        frozen = freeze_heap()
                        logger.info("froze %s objects alive after startup out of the GC", frozen)
                    url = _bound_url(self, settings)
                    logger.info(
                        "momlp serving %s at %s (API docs at %s/docs)", settings.store, url, url
                    )

        server = _Server(uvicorn_config(app, settings))
        count_connections(app, server)
        received: list[int] = []

        def remember(sig: int, _frame: FrameType | None) -> None:
            received.append(sig)

        # uvicorn handles SIGINT/SIGTERM during serving and re-raises them afterwards so the
        # default action runs; these handlers absorb that re-raise so a requested stop exits 0.
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, remember) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run()
        except SystemExit as exc:
            # uvicorn exits this way when the lifespan fails or the port cannot be bound; it
            # has logged why. Ray still shuts down on the way out, and the caller gets 1.
            if server.started or exc.code != STARTUP_FAILURE:
                raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not server.started:
            logger.error("momlp did not start (see the errors above)")
            return 1
        logger.info("momlp stopped")
        return 0
