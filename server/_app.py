"""The FastAPI app: `create_app(settings, pool_factory=...)`; the lifespan owns every resource.

A *generation* is one store version with its router, pool and batcher. The lifespan builds the
first one, the store watcher (when enabled) builds the next one and swaps it in atomically,
and each request holds the generation it started on until it has answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
import torch
from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from experts_store import Clock, MonotonicClock
from server._admin import add_admin_routes
from server._auth import ApiKeyMiddleware
from server._exceptions import NotReady, RequestTimeout
from server._generation import BatcherFactory, Generation, PoolFactory, ServingState
from server._http_body import HttpError, parse_inputs
from server._http_errors import CatchAllMiddleware, install_error_handlers
from server._http_models import (
    ErrorResponse,
    ExpertsResponse,
    HealthResponse,
    ModelResponse,
    PredictRequest,
    PredictResponse,
    ReadyResponse,
    RouteRequest,
    RouteResponse,
)
from server._metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from server._settings import Settings

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_MAX_PROTOTYPE_VALUES = 10_000_000
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (401, "missing or wrong bearer key"),
        (413, "too many rows or bytes"),
        (415, "unsupported Content-Type"),
        (422, "bad shape, dimension, number or option"),
        (429, "queue full; see Retry-After"),
        (503, "an expert cannot be loaded, or not ready"),
        (504, "no answer in time"),
    )
}
_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _body_doc(model: type[RouteRequest]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": model.model_json_schema()},
                "application/x-npy": _BINARY,
                "application/octet-stream": _BINARY,
            },
        }
    }


def _serving(request: Request) -> ServingState:
    state: ServingState = request.app.state.serving
    return state


Serving = Annotated[ServingState, Depends(_serving)]
Mode = Literal["tree", "exact"]


def create_app(
    settings: Settings,
    *,
    pool_factory: PoolFactory | None = None,
    batcher_factory: BatcherFactory | None = None,
    clock: Clock | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """A momlp app serving `settings.store`.

    `pool_factory(settings, store)` builds the expert pool (default: Ray actors; tests pass
    the in-process `FakeExpertPool`); nothing is built until the lifespan starts.
    """
    serving = ServingState(
        settings=settings,
        metrics=metrics or Metrics(),
        clock=clock or MonotonicClock(),
        pool_factory=pool_factory,
        batcher_factory=batcher_factory,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await serving.start()
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
    serving.metrics.set_snapshot(serving.pool_snapshot)
    install_error_handlers(app)
    _add_routes(app)
    add_admin_routes(app)
    # Starlette runs the last added middleware first: metrics see every answer, the catch-all
    # answers whatever escaped, and the key check runs before any route or body is touched.
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(
        MetricsMiddleware,
        metrics=serving.metrics,
        known_paths=[getattr(r, "path", "") for r in app.routes],
    )
    return app


class _Inputs(NamedTuple):
    x: np.ndarray[Any, np.dtype[np.float32]]
    top_k: int
    mode: Mode
    return_stats: bool


async def _inputs(
    request: Request,
    gen: Generation,
    settings: Settings,
    model: type[RouteRequest],
    top_k: int | None,
    mode: Mode | None,
    return_stats: bool,
) -> _Inputs:
    parsed = await parse_inputs(
        request,
        max_bytes=settings.max_body_bytes,
        max_rows=settings.max_rows,
        input_dim=gen.manifest.input_dim,
        top_k=top_k,
        mode=mode,
        return_stats=return_stats,
        model=model,
        body_timeout_s=settings.body_timeout_s,
    )
    k = parsed.top_k or settings.default_top_k
    if k > gen.manifest.num_experts:
        raise HttpError(
            422,
            "invalid_input",
            f"top_k={k} exceeds the {gen.manifest.num_experts} experts of this model",
            detail={"top_k": k, "num_experts": gen.manifest.num_experts},
        )
    mode = parsed.mode or settings.default_mode or gen.default_mode
    return _Inputs(parsed.x, k, mode, parsed.return_stats)


def _add_routes(app: FastAPI) -> None:
    @app.post(
        "/v1/predict",
        response_model=PredictResponse,
        responses=_ERRORS,
        openapi_extra=_body_doc(PredictRequest),
        summary="Predict: route each row to its expert(s) and run them",
    )
    async def predict(
        request: Request,
        serving: Serving,
        top_k: Annotated[int | None, Query(ge=1, description="binary bodies only")] = None,
        mode: Annotated[Mode | None, Query(description="binary bodies only")] = None,
        return_stats: Annotated[bool, Query(description="binary bodies only")] = False,
    ) -> Response:
        start = time.perf_counter()
        settings = serving.settings
        async with serving.use() as gen:
            parsed = await _inputs(
                request, gen, settings, PredictRequest, top_k, mode, return_stats
            )
            x = torch.from_numpy(parsed.x)
            try:
                answer = await asyncio.wait_for(
                    gen.batcher.submit(x, top_k=parsed.top_k, mode=parsed.mode),
                    timeout=settings.request_timeout_s,
                )
            except TimeoutError:
                raise RequestTimeout(timeout_s=settings.request_timeout_s) from None
        serving.metrics.observe_prediction(x.shape[0], [(s.cache, s.load_ms) for s in answer.stats])
        serving.after_prediction(gen)
        body: dict[str, Any] = {
            "outputs": answer.outputs.tolist(),
            "experts": answer.experts.tolist(),
            "weights": answer.weights.tolist(),
            "store_version": gen.version,
            "stats": None,
        }
        if parsed.return_stats:
            body["stats"] = {
                "experts": [vars(stat).copy() for stat in answer.stats],
                "vram_bytes": answer.vram_bytes,
                "device_bytes": dict(answer.device_bytes),
                "distance_evals": answer.distance_evals.tolist(),
                "route_ms": answer.route_ms,
                "queue_ms": answer.queue_ms,
                "total_ms": max(answer.total_ms, (time.perf_counter() - start) * 1000.0),
            }
        return JSONResponse(body)

    @app.post(
        "/v1/route",
        response_model=RouteResponse,
        responses=_ERRORS,
        openapi_extra=_body_doc(RouteRequest),
        summary="Route only: which experts, with which weights; loads nothing",
    )
    async def route(
        request: Request,
        serving: Serving,
        top_k: Annotated[int | None, Query(ge=1, description="binary bodies only")] = None,
        mode: Annotated[Mode | None, Query(description="binary bodies only")] = None,
    ) -> Response:
        async with serving.use() as gen:
            parsed = await _inputs(request, gen, serving.settings, RouteRequest, top_k, mode, False)
            x = torch.from_numpy(parsed.x)
            routing = await run_in_threadpool(
                gen.router.route, x, mode=parsed.mode, top_k=parsed.top_k
            )
        return JSONResponse(
            {
                "experts": routing.experts.tolist(),
                "weights": routing.weights.tolist(),
                "distances": routing.distances.tolist(),
                "distance_evals": routing.distance_evals.tolist(),
                "store_version": gen.version,
            }
        )

    @app.get("/v1/model", response_model=ModelResponse, responses=_ERRORS)
    async def model(
        serving: Serving,
        include_prototypes: Annotated[bool, Query()] = False,
    ) -> Response:
        gen = serving.current()
        m = gen.manifest
        prototypes = None
        if include_prototypes and m.num_experts * m.input_dim <= _MAX_PROTOTYPE_VALUES:
            prototypes = gen.router.prototypes.tolist()
        return JSONResponse(
            {
                "store_version": m.store_version,
                "format_version": m.format_version,
                "task": m.task,
                "input_dim": m.input_dim,
                "output_dim": m.output_dim,
                "num_experts": m.num_experts,
                "branching": m.branching,
                "routing": m.routing,
                "temperature": m.temperature,
                "total_expert_bytes": m.total_expert_bytes,
                "max_expert_bytes": max((e.bytes for e in m.experts), default=0),
                "total_params": sum(e.params for e in m.experts),
                "prototypes": prototypes,
            }
        )

    @app.get("/v1/experts", response_model=ExpertsResponse, responses=_ERRORS)
    async def experts(serving: Serving) -> Response:
        gen = serving.current()
        residency = gen.pool.residency()
        return JSONResponse(
            {
                "experts": [
                    {
                        "id": e.id,
                        "bytes": e.bytes,
                        "params": e.params,
                        "actors": sorted(residency.get(e.id, [])),
                    }
                    for e in gen.manifest.experts
                ],
                "actors": [
                    {
                        "name": a.name,
                        "device": a.device,
                        "resident_bytes": a.resident_bytes,
                        "budget_bytes": a.budget_bytes,
                        "resident": sorted(a.resident),
                        "alive": a.alive,
                    }
                    for a in gen.pool.actors()
                ],
            }
        )

    @app.get("/healthz", response_model=HealthResponse)
    async def healthz() -> HealthResponse:
        return HealthResponse()

    @app.get("/readyz", response_model=ReadyResponse, responses={503: _ERRORS[503]})
    async def readyz(serving: Serving) -> ReadyResponse:
        gen = serving.generation
        if gen is None or serving.stopping:
            raise NotReady(reason="the store and the pool are not up")
        return ReadyResponse(store_version=gen.version)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics(serving: Serving) -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)
