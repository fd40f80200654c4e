"""The v1 endpoints besides predict and route (`_predict`): model, experts, health, readiness
and metrics.

Each response is the pydantic model the schema documents, serialised by pydantic's own JSON
encoder, but for /v1/experts' list of every expert: plain dicts of its model's shape (one model
per expert is too slow at K=100,000).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import Response

from experts_store import Pace
from server._exceptions import NotReady
from server.http._metrics import CONTENT_TYPE, Metrics
from server.http._models import (
    ActorInfoModel,
    ExpertsResponse,
    HealthResponse,
    HyperSummary,
    ModelResponse,
    ReadyResponse,
)
from server.http._responses import ERROR_RESPONSES, model_response
from server.kinds import HyperSection
from server.pool import ActorInfo
from server.serving import ServingState, StoreVersion, background_pacer, in_daemon_thread

__all__ = ["add_routes"]

_MAX_PROTOTYPE_VALUES = 10_000_000


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


def _hyper_summary(section: HyperSection | None) -> HyperSummary | None:
    return None if section is None else HyperSummary.model_construct(**vars(section))


def add_routes(app: FastAPI) -> None:
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
            suspect=a.suspect,
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
