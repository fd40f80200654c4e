"""The FastAPI app: `create_app(settings, pool_factory=...)`; the lifespan owns every resource.

The lifespan builds the actor pool once and opens the store's current version; the store
watcher (when enabled) swaps newer versions in as data, and each request keeps the version it
entered until it has answered (`server.serving`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from experts_store import Clock, ExpertTooLarge, MonotonicClock
from server._settings import Settings
from server.batching import OpenConnections
from server.http._admin import add_admin_routes
from server.http._auth import ApiKeyMiddleware
from server.http._deadline import Deadlines
from server.http._errors import CatchAllMiddleware, install_error_handlers
from server.http._graph import add_graph_routes
from server.http._hot import HotRoutes
from server.http._hyper import add_hyper_routes
from server.http._metrics import Metrics, MetricsMiddleware, PoolSnapshot
from server.http._openapi import install_openapi
from server.http._predict import HOT_ROUTES, add_predict_routes
from server.http._request_id import RequestIdMiddleware
from server.http._routes import add_routes
from server.http._startup import STARTUP_ERRORS, StartupFailure
from server.http._v2 import add_v2_routes, hot_v2_routes, model_name
from server.serving import BatcherFactory, PoolFactory, ServingState

__all__ = ["create_app", "pool_snapshot"]

logger = logging.getLogger(__name__)


def pool_snapshot(serving: ServingState) -> PoolSnapshot | None:
    """What the pool looks like now, for the metrics scrape."""
    pool, version = serving.pool, serving.version
    if pool is None:
        return None
    actors = pool.actors()
    return PoolSnapshot(
        resident_bytes={a.name: a.resident_bytes for a in actors},
        budget_bytes={a.name: a.budget_bytes for a in actors},
        # The actors count their own loads and evictions exactly (each since it last
        # started): a load that several requests waited for counts once.
        counts={a.name: a.counts for a in actors},
        queue_rows=serving.queued_rows,
        alive={a.name: a.alive for a in actors},
        failures={a.name: a.failures for a in actors},
        suspect={a.name: a.suspect for a in actors},
        suspicions={a.name: (a.suspicions, a.given_up_calls) for a in actors},
        store_version=version.version if version is not None else None,
        store_kind=version.model.kind if version is not None else None,
        refused_version=serving.refused_version,
    )


def create_app(
    settings: Settings,
    *,
    pool_factory: PoolFactory | None = None,
    batcher_factory: BatcherFactory | None = None,
    clock: Clock | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """A momlp app serving `settings.store`.

    `pool_factory(settings)` builds the expert pool (default: Ray actors in the Ray this
    process runs, see `server.pool.ray_session`; tests pass the in-process `FakeExpertPool`);
    nothing is built until the lifespan starts. The HTTP server that runs the app may attach
    its count of open connections to `app.state.connections` (`OpenConnections`), which lets a
    batch window close as soon as no other client can send (`run_server` does, for uvicorn).
    """
    metrics = metrics or Metrics()
    connections = OpenConnections()
    serving = ServingState(
        settings=settings,
        clock=clock or MonotonicClock(),
        pool_factory=pool_factory,
        batcher_factory=batcher_factory,
        on_batch=metrics.observe_batch,
        on_generated=metrics.observe_generations,
        open_connections=connections,
    )

    failure = StartupFailure()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await serving.start()
        except STARTUP_ERRORS as exc:
            failure.message = f"cannot serve {settings.store}: {exc}"
            if isinstance(exc, ExpertTooLarge):
                failure.message += " (each actor's budget: --cache-bytes, MOMLP_CACHE_BYTES)"
            raise
        try:
            yield
        finally:
            await serving.stop()

    app = FastAPI(
        title="momlp",
        version="1",
        summary="A mixture of expert MLPs routed by a prototype tree.",
        lifespan=lifespan,
    )
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.connections = connections
    app.state.deadlines = Deadlines.of(settings)
    metrics.set_snapshot(lambda: pool_snapshot(serving))
    install_error_handlers(app)
    add_predict_routes(app)
    add_routes(app)
    add_graph_routes(app)
    add_v2_routes(app)
    add_admin_routes(app)
    add_hyper_routes(app)
    install_openapi(app, serving, model_name(settings))
    # Starlette runs the last added middleware first: every answer carries a request id,
    # metrics see every answer, the catch-all answers whatever escaped, the key check runs
    # before any route or body is touched, and then the hot endpoints skip FastAPI's routing.
    # The catch-all also puts a known reason the lifespan could not start in place of its
    # traceback.
    app.add_middleware(HotRoutes, routes={**HOT_ROUTES, **hot_v2_routes(settings)})
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(CatchAllMiddleware, startup=failure)
    app.add_middleware(
        MetricsMiddleware,
        metrics=metrics,
        known_paths=[getattr(r, "path", "") for r in app.routes],
    )
    app.add_middleware(RequestIdMiddleware)
    return app
