"""Graph stores over HTTP: `GET /v1/graph` (nodes, edges, K_v, bytes, waves) and the graph
fields of a prediction (`nodes`: each node's expert per row; `stats.graph`: waves, VRAM per
wave, distance evaluations per node)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel

from server._exceptions import HttpError
from server.batching import BatchAnswer
from server.http._models import ErrorResponse, GraphStatsModel
from server.kinds import GraphRouting, graph_layout
from server.serving import ServingState

__all__ = ["GraphResponse", "add_graph_routes", "graph_fields"]


class GraphNodeModel(BaseModel):
    name: str
    inputs: list[str]
    output_dim: int
    num_experts: int  # K_v
    branching: int
    experts: list[int]  # global ids, in the node's prototype order
    bytes: int  # all K_v experts' files
    max_expert_bytes: int  # the node's largest file
    device_bytes: int  # all K_v experts once loaded (parameters: what the cache counts)
    max_expert_device_bytes: int  # the node's largest loaded: what one row needs of it
    wave: int


class GraphResponse(BaseModel):
    store_version: str
    input_dim: int
    output_dim: int
    outputs: list[str]
    waves: list[list[str]]
    nodes: list[GraphNodeModel]
    edges: list[tuple[str, str]]  # (source, node); a source "x:i" is input column i
    total_expert_bytes: int  # files
    total_expert_device_bytes: int  # every expert resident
    one_expert_per_node_device_bytes: int  # sum over nodes of each node's largest, loaded
    max_distance_evals: int  # Σ_v ν_v·depth_v: the most a row's tree walks can cost


def graph_fields(
    answer: BatchAnswer, return_stats: bool
) -> tuple[dict[str, list[int]] | None, GraphStatsModel | None]:
    """A graph prediction's `nodes` and `stats.graph`; (None, None) for other kinds."""
    # The batch's routing tells the kind; only a graph answer pays for its own slice.
    if not isinstance(answer.batch_routing, GraphRouting):
        return None, None
    routing = answer.routing
    assert isinstance(routing, GraphRouting)
    per_node = routing.per_node()
    nodes = {name: experts for name, (experts, _) in per_node.items()}
    if not return_stats:
        return nodes, None
    waves = answer.wave_vram_bytes
    return nodes, GraphStatsModel.model_construct(
        waves=len(waves),
        wave_vram_bytes=waves,
        peak_wave_vram_bytes=max(waves, default=0),
        node_distance_evals={name: evals for name, (_, evals) in per_node.items()},
    )


def add_graph_routes(app: FastAPI) -> None:
    @app.get(
        "/v1/graph",
        response_model=GraphResponse,
        responses={404: {"model": ErrorResponse, "description": "not a graph store"}},
        summary="The served graph store's nodes, edges, K_v and bytes",
    )
    async def graph() -> Response:
        state: ServingState = app.state.serving
        version = state.current()
        m = version.manifest
        model = version.model
        layout = graph_layout(model)
        if layout is None:
            raise HttpError(404, "not_found", f"the served store is of kind {m.kind!r}, not graph")
        graph = layout.graph
        wave_of = {name: w for w, names in enumerate(graph.waves()) for name in names}
        nodes = [
            GraphNodeModel.model_construct(
                name=n.name, inputs=list(n.inputs), output_dim=n.output_dim,
                num_experts=n.num_experts, branching=n.branching, experts=list(n.experts),
                bytes=sum(m.experts[e].bytes for e in n.experts),
                max_expert_bytes=max(m.experts[e].bytes for e in n.experts),
                device_bytes=sum(model.experts[e].nbytes for e in n.experts),
                max_expert_device_bytes=max(model.experts[e].nbytes for e in n.experts),
                wave=wave_of[n.name],
            )
            for n in graph.nodes
        ]
        body = GraphResponse.model_construct(
            store_version=m.store_version, input_dim=m.input_dim, output_dim=m.output_dim,
            outputs=list(graph.outputs), waves=graph.waves(), nodes=nodes,
            edges=graph.edges, total_expert_bytes=m.total_expert_bytes,
            total_expert_device_bytes=sum(ref.nbytes for ref in model.experts),
            one_expert_per_node_device_bytes=sum(n.max_expert_device_bytes for n in nodes),
            max_distance_evals=layout.max_distance_evals,
        )
        return Response(body.model_dump_json(), media_type="application/json")
