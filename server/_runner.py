"""Run the app under uvicorn: Ray up first, the URL logged when ready, clean exit on a signal.

uvicorn's graceful shutdown lets in-flight requests finish, then the lifespan closes the pool;
Ray is shut down last, and only if this process started (or connected) it.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from server._settings import Settings

__all__ = ["ensure_ray", "run_server", "shutdown_ray"]

logger = logging.getLogger(__name__)

_GRACE_S = 10.0


def ensure_ray(settings: Settings) -> bool:
    """Start an embedded Ray, or connect to `settings.ray_address`; False if Ray was already up."""
    import ray

    if ray.is_initialized():
        return False
    if settings.ray_address:
        logger.info("connecting to the Ray cluster at %s", settings.ray_address)
        ray.init(address=settings.ray_address, configure_logging=False, log_to_driver=False)
    else:
        # address="local": a bare ray.init() would attach to any cluster `ray start` left behind.
        logger.info("starting an embedded Ray")
        ray.init(
            address="local",
            num_cpus=settings.ray_num_cpus,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )
    return True


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        started = time.monotonic()
        ray.shutdown()
        logger.info("Ray shut down in %.1f s", time.monotonic() - started)


def _bound_url(server: Any, settings: Settings) -> str:
    for srv in getattr(server, "servers", []):
        for sock in getattr(srv, "sockets", []):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                host, port = sock.getsockname()[:2]
                if sock.family == socket.AF_INET6:
                    host = f"[{host}]"
                return f"http://{host}:{port}"
    return f"http://{settings.host}:{settings.port}"


def run_server(settings: Settings, *, app_factory: Callable[[Settings], Any] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; 0 after a clean shutdown, 1 if startup failed."""
    import uvicorn

    from server._app import create_app

    started_ray = ensure_ray(settings)
    try:
        app = (app_factory or create_app)(settings)

        class _Server(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                if self.started:
                    url = _bound_url(self, settings)
                    logger.info(
                        "momlp serving %s at %s (API docs at %s/docs)", settings.store, url, url
                    )

        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            lifespan="on",
            timeout_graceful_shutdown=int(max(_GRACE_S, settings.request_timeout_s)),
        )
        server = _Server(config)
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
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not server.started:
            logger.error("momlp did not start (see the errors above)")
            return 1
        logger.info("momlp stopped")
        return 0
    finally:
        if started_ray:
            shutdown_ray()
