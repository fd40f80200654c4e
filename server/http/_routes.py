"""The v1 endpoints: predict, route, model, experts, health, readiness and metrics.

Each request body is parsed and checked once here (`_body.parse_inputs`) into typed rows and
options; the layers below trust them. Each response is the pydantic model the schema
documents, serialised by pydantic's own JSON encoder, but for /v1/experts' list of every
expert: plain dicts of its model's shape (one model per expert is too slow at K=100,000).
"""

from __future__ import annotations

import json
import time
from collections.abc import Hashable
from typing import Annotated, Any, NamedTuple

import numpy as np
import torch
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from experts_store import Pace
from server._exceptions import NotReady, RequestTimeout
from server._settings import Settings
from server.batching import BatchAnswer
from server.http._body import parse_inputs
from server.http._construct import trusted
from server.http._deadline import Deadline, Deadlines
from server.http._graph import graph_fields
from server.http._hot import HotRoute
from server.http._metrics import CONTENT_TYPE, Metrics
from server.http._models import (
    ActorInfoModel,
    ErrorResponse,
    ExpertPatchesModel,
    ExpertsResponse,
    ExpertStatModel,
    GateQuery,
    HealthResponse,
    HyperSummary,
    ModelResponse,
    PredictRequest,
    PredictResponse,
    PredictStats,
    ReadyResponse,
    RouteRequest,
    RouteResponse,
)
from server.http._openapi import inline_defs
from server.http._paths import PREDICT_PATH, ROUTE_PATH
from server.kinds import (
    GateRequest,
    HyperSection,
    attach_conditions,
    patch_inputs,
    patch_routing,
)
from server.pool import ActorInfo
from server.serving import ServingState, StoreVersion, background_pacer, in_daemon_thread

__all__ = [
    "ERROR_RESPONSES", "HOT_ROUTES", "add_routes", "model_response", "predict", "route",
    "submit_in_time",
]  # fmt: skip

_MAX_PROTOTYPE_VALUES = 10_000_000
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
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


def model_response(model: BaseModel) -> Response:
    """`model` as the JSON body (pydantic's encoder: the documented shape, no second dict)."""
    return Response(model.model_dump_json(), media_type="application/json")


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


# Dependencies are `async def`: FastAPI runs a plain `def` one on a worker thread, a thread
# hop per dependency per request.
async def _serving(request: Request) -> ServingState:
    state: ServingState = request.app.state.serving
    return state


async def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


Serving = Annotated[ServingState, Depends(_serving)]
AppMetrics = Annotated[Metrics, Depends(_metrics)]


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


def _hyper_summary(section: HyperSection | None) -> HyperSummary | None:
    return None if section is None else HyperSummary.model_construct(**vars(section))


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
) -> BatchAnswer:
    """The version's batcher's answer, or `RequestTimeout` past `deadline`."""
    try:
        # A shared `Deadline`, not `asyncio.timeout`: no timer armed per request.
        async with deadline.scope():
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
            version, parsed.x, parsed.options, _deadlines(request).answer
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


def add_routes(app: FastAPI) -> None:
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

    @app.get("/v1/model", response_model=ModelResponse, responses=ERROR_RESPONSES)
    async def model(
        serving: Serving,
        include_prototypes: Annotated[bool, Query()] = False,
    ) -> Response:
        version = serving.current()
        m = version.manifest
        # The kind says what it adds to the manifest's common fields.
        section = version.model.model_section()
        prototypes = None
        if include_prototypes and m.num_experts * m.input_dim <= _MAX_PROTOTYPE_VALUES:
            table = version.model.prototypes()
            prototypes = table.tolist() if table is not None else None
        return model_response(
            ModelResponse.model_construct(
                store_version=m.store_version,
                format_version=m.format_version,
                task=m.task,
                input_dim=m.input_dim,
                output_dim=m.output_dim,
                num_experts=version.model.routable_experts,
                branching=m.branching,
                routing=m.routing,
                temperature=m.temperature,
                kind=m.kind,
                gate=m.gate_spec,
                pmoe=section.pmoe,
                total_expert_bytes=m.total_expert_bytes,
                max_expert_bytes=max((e.bytes for e in m.experts), default=0),
                total_params=sum(e.params for e in m.experts),
                prototypes=prototypes,
                hyper=_hyper_summary(section.hyper),
            )
        )

    @app.get("/v1/experts", response_model=ExpertsResponse, responses=ERROR_RESPONSES)
    async def experts(serving: Serving) -> Response:
        # Entered like a request, so that a swap does not free the version's rows under it.
        async with serving.use() as version:
            pool = serving.pool
            if pool is None:
                raise NotReady(reason="the actor pool is not up")
            # The pool knows experts by content; this version names them by id.
            residency, actors = pool.residency(), pool.actors()
            # At K=100,000 the answer is 5 MB and ~0.3 s of Python: built on a thread at a
            # pace, not on the event loop (benchmarks/RESULTS.md, fifty-third session).
            body = await in_daemon_thread(
                _experts_body, version, residency, actors, background_pacer()
            )
        return Response(body, media_type="application/json")

    @app.get("/healthz", response_model=HealthResponse)
    async def healthz() -> HealthResponse:
        return HealthResponse()

    @app.get("/readyz", response_model=ReadyResponse, responses={503: ERROR_RESPONSES[503]})
    async def readyz(serving: Serving) -> ReadyResponse:
        return ReadyResponse(store_version=serving.check_ready().version)

    # HEAD too (load balancers and uptime monitors often probe with it), kept out of the
    # schema: one operation per path and method there.
    for path, probe in (("/healthz", healthz), ("/readyz", readyz)):
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics(metrics: AppMetrics) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _experts_body(
    version: StoreVersion,
    residency: dict[str, list[str]],
    actors: list[ActorInfo],
    pace: Pace,
) -> str:
    """GET /v1/experts's JSON: ExpertsResponse's shape from plain dicts (one response model
    per expert cost 1.06 s at K=100,000: fifty-second session); `pace` after each expert."""
    ids = version.expert_ids
    actor_rows = [
        ActorInfoModel.model_construct(
            name=a.name,
            device=a.device,
            resident_bytes=a.resident_bytes,
            budget_bytes=a.budget_bytes,
            resident=sorted(i for key in a.resident for i in ids.get(key, [])),
            alive=a.alive,
        ).model_dump()
        for a in actors
    ]
    experts: list[dict[str, Any]] = []
    for i, size, params, sha in version.expert_rows:
        experts.append(
            {"id": i, "bytes": size, "params": params,
             "actors": sorted(residency[sha]) if sha in residency else []}
        )
        pace()
    return json.dumps({"experts": experts, "actors": actor_rows}, separators=(",", ":"))
