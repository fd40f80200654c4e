"""POST /v1/predict and /v1/route, the hot endpoints: `HotRoutes` calls them directly.

Each request body is parsed and checked once here (`_forms.parse_inputs`) into typed rows
and options; the layers below trust them. Each response is the pydantic model the schema
documents, serialised by pydantic's own JSON encoder.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, MutableMapping
from typing import Any, NamedTuple

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from server._exceptions import RequestTimeout
from server._settings import Settings
from server.batching import BatchAnswer
from server.http._construct import trusted
from server.http._deadline import Deadline, Deadlines
from server.http._forms import parse_inputs
from server.http._graph import graph_fields
from server.http._hot import HotRoute
from server.http._metrics import Metrics
from server.http._models import (
    ExpertPatchesModel,
    ExpertStatModel,
    GateQuery,
    PredictRequest,
    PredictResponse,
    PredictStats,
    RouteRequest,
    RouteResponse,
)
from server.http._openapi import inline_defs
from server.http._paths import PREDICT_PATH, ROUTE_PATH
from server.http._responses import ERROR_RESPONSES, model_response
from server.kinds import GateRequest, attach_conditions, patch_inputs, patch_routing
from server.serving import ServingState, StoreVersion

__all__ = ["HOT_ROUTES", "add_predict_routes", "predict", "route", "submit_in_time"]

_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _body_doc(model: type[RouteRequest]) -> dict[str, Any]:
    return {
        "parameters": _query_doc(returns=model is PredictRequest),
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": inline_defs(model.model_json_schema())},
                "application/x-npy": _BINARY,
                "application/octet-stream": _BINARY,
            },
        }
    }


class _Inputs(NamedTuple):
    x: np.ndarray[Any, np.dtype[np.float32]]
    options: Hashable  # the kind's resolved options (for momlp a router.Gate)
    return_stats: bool
    return_routing: bool = False


_NO_QUERY = GateQuery()


def _query(request: Request) -> GateQuery:
    """The query string of predict and route, parsed here rather than by FastAPI.

    FastAPI solves one dependency per parameter on every request (~0.1-0.2 ms of the event
    loop for these nine), and a JSON body, the common case, carries no query string at all.
    """
    if not request.scope.get("query_string"):
        return _NO_QUERY
    try:
        return GateQuery.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise RequestValidationError(
            [{**error, "loc": ("query", *error["loc"])} for error in exc.errors()]
        ) from None


def _query_gate(query: GateQuery) -> GateRequest:
    """The gate of a binary body, from the query string (a JSON body carries its own)."""
    widths = tuple(int(w) for w in query.beam.split(",")) if query.beam is not None else None
    return GateRequest(
        query.top_k, query.mode, query.temperature, query.min_weight, query.top_p, widths,
        query.score,
    )


def _query_doc(*, returns: bool) -> list[dict[str, Any]]:
    """`GateQuery` as OpenAPI query parameters (the routes read it themselves); `returns`:
    with the parameters that choose what predict returns."""
    schema = GateQuery.model_json_schema()
    return [
        {
            "name": name,
            "in": "query",
            "required": False,
            "schema": {key: value for key, value in field.items() if key != "description"},
            "description": field.get("description", ""),
        }
        for name, field in schema["properties"].items()
        if returns or not name.startswith("return_")
    ]


def _deadlines(request: Request) -> Deadlines:
    deadlines: Deadlines = request.app.state.deadlines
    return deadlines


async def _inputs(
    request: Request,
    version: StoreVersion,
    settings: Settings,
    model: type[RouteRequest],
    gate: GateRequest,
    return_stats: bool,
    return_routing: bool = False,
) -> _Inputs:
    patch_model = patch_inputs(version.model)
    parsed = await parse_inputs(
        request,
        max_bytes=settings.max_body_bytes,
        max_rows=settings.max_rows,
        input_dim=version.manifest.input_dim,
        gate=gate,
        return_stats=return_stats,
        model=model,
        body_deadline=_deadlines(request).body,
        image=patch_model,
        return_routing=return_routing,
    )
    # The store's kind resolves the gate against its defaults and the server's caps, once.
    options = version.model.resolve(parsed.gate, settings)
    # A kind that takes conditions (hyper) gets them as extra columns of each row.
    x = attach_conditions(version.model, parsed.x, parsed.conditions, settings)
    return _Inputs(x, options, parsed.return_stats, parsed.return_routing)


def _patch_rows(routing: Any) -> list[list[ExpertPatchesModel]] | None:
    """Each row's patch choices, when the kind's routing has them (else None: for other
    kinds `experts` and `weights` already are the whole routing)."""
    patches = patch_routing(routing)
    if patches is None:
        return None
    return [
        [ExpertPatchesModel.model_construct(**vars(choice)) for choice in row]
        for row in patches.patch_choices()
    ]


def _routed_only(experts: torch.Tensor, *columns: torch.Tensor) -> list[list[list[Any]]]:
    """`experts` and each of `columns` as ragged rows of the entries with an expert (>= 0).

    Those need not come first: a graph store's columns are its nodes in manifest order, -1
    where a node is not in the first wave, and a spec may list a later node before it.
    """
    tables = [experts.tolist(), *(c.tolist() for c in columns)]
    mask = experts >= 0
    if bool(mask.all()):
        return tables
    keep = mask.tolist()
    return [
        [
            [v for v, k in zip(row, kept, strict=True) if k]
            for row, kept in zip(t, keep, strict=True)
        ]
        for t in tables
    ]


async def submit_in_time(
    version: StoreVersion,
    x: torch.Tensor | np.ndarray,
    options: Hashable,
    deadline: Deadline,
    asgi_scope: MutableMapping[str, Any],
) -> BatchAnswer:
    """The version's batcher's answer; `RequestTimeout` past `deadline`, `ClientDisconnect`
    when the request's connection (its `asgi_scope`) is lost first."""
    try:
        # A shared `Deadline`, not `asyncio.timeout`: no timer armed per request.
        async with deadline.scope(asgi_scope):
            return await version.batcher.submit(x, options)
    except TimeoutError:
        raise RequestTimeout(timeout_s=deadline.timeout_s) from None


async def predict(request: Request) -> Response:
    """POST /v1/predict. Takes only `request`: FastAPI solves no dependency per call, and
    `HotRoutes` calls it without FastAPI's router (see `_query`)."""
    start = time.perf_counter()
    serving: ServingState = request.app.state.serving
    metrics: Metrics = request.app.state.metrics
    query = _query(request)
    settings = serving.settings
    async with serving.use() as version:
        parsed = await _inputs(
            request, version, settings, PredictRequest, _query_gate(query),
            query.return_stats, query.return_routing,
        )
        answer = await submit_in_time(
            version, parsed.x, parsed.options, _deadlines(request).answer, request.scope
        )
    metrics.observe_prediction(parsed.x.shape[0], [(s.cache, s.load_ms) for s in answer.stats])
    nodes, graph_stats = graph_fields(answer, parsed.return_stats)
    # This request's slice of a pMoE routing (its patches); other kinds' answers never look,
    # and a slice is several tensor ops. The batch's routing has the slice's type.
    patches = (
        patch_routing(answer.routing) if patch_routing(answer.batch_routing) is not None else None
    )
    stats = None
    if parsed.return_stats:
        stats = trusted(
            PredictStats,
            experts=[trusted(ExpertStatModel, **vars(s)) for s in answer.stats],
            vram_bytes=answer.vram_bytes,
            device_bytes=dict(answer.device_bytes),
            distance_evals=answer.distance_evals.tolist(),
            route_ms=answer.route_ms,
            queue_ms=answer.queue_ms,
            total_ms=max(answer.total_ms, (time.perf_counter() - start) * 1000.0),
            patches_computed=None if patches is None else sum(s.rows for s in answer.stats),
            patches_dense=None if patches is None else patches.dense_patches,
            graph=graph_stats,
        )
    kept = answer.kept()
    return model_response(
        trusted(
            PredictResponse,
            outputs=answer.outputs.tolist(),
            experts=[experts for experts, _ in kept],
            weights=[weights for _, weights in kept],
            store_version=version.version,
            stats=stats,
            patches=_patch_rows(patches) if parsed.return_routing else None,
            nodes=nodes,
        )
    )


async def route(request: Request) -> Response:
    """POST /v1/route (like `predict`, called by `HotRoutes`)."""
    serving: ServingState = request.app.state.serving
    gate = _query_gate(_query(request))
    async with serving.use() as version:
        parsed = await _inputs(request, version, serving.settings, RouteRequest, gate, False)
        x = torch.from_numpy(parsed.x)
        routing = await version.route_runner(x, parsed.options)
    experts, weights, distances = _routed_only(
        routing.experts, routing.weights, routing.distances
    )
    return model_response(
        RouteResponse.model_construct(
            experts=experts,
            weights=weights,
            distances=distances,
            distance_evals=routing.distance_evals.tolist(),
            store_version=version.version,
            patches=_patch_rows(routing),
        )
    )


# The hot endpoints, called straight from `HotRoutes` (their FastAPI routes document them).
HOT_ROUTES = {
    ("POST", PREDICT_PATH): HotRoute(predict, PREDICT_PATH),
    ("POST", ROUTE_PATH): HotRoute(route, ROUTE_PATH),
}


def add_predict_routes(app: FastAPI) -> None:
    """The hot endpoints' FastAPI routes: they document them (OpenAPI) and serve a request
    `HotRoutes` passes on."""
    app.post(
        PREDICT_PATH,
        response_model=PredictResponse,
        responses=ERROR_RESPONSES,
        openapi_extra=_body_doc(PredictRequest),
        summary="Predict: route each row to its expert(s) and run them",
    )(predict)
    app.post(
        ROUTE_PATH,
        response_model=RouteResponse,
        responses=ERROR_RESPONSES,
        openapi_extra=_body_doc(RouteRequest),
        summary="Route only: which experts, with which weights; loads nothing",
    )(route)
