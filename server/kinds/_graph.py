"""Kind "graph": a DAG of small mixtures (seed 004), served in topological waves.

Each wave is one round of plan -> pool -> combine. Plan routes every node of the wave on its
inputs (raw input columns, or earlier waves' outputs) with the node's own prototype tree,
one expert per row, and makes one group per (node, expert) with that node's label; the pool
runs them on the same actors and caches as any kind (the key is the expert's `ExpertRef`).
Combine writes each group's outputs into its node's column block, rows in input order: a
node's output is its one expert's float32 output (weight 1, nothing to accumulate), so a
row's outputs never depend on the other rows of its batch.

A failed group (a corrupt or deleted node expert) marks its rows dead: later waves neither
route nor run them, and the batcher fails only the requests holding them (503 naming node
and expert). Route routes wave 0 (on the event loop or in a thread, as the batcher's
`RouteRunner` decides); later waves route inside `plan` (small trees in 2-3 dimensions:
microseconds per row). Routing is filled in wave by wave
into the `GraphRouting` the batcher passed to `start`, so each request's slice of it, taken
after the last round, reports every node's expert per row.

Not done: keeping a node's subtree on one actor. Each wave is one pool call whose groups the
dispatcher places by expert (home actor, least queued), so a graph of W waves costs W round
trips per batch whatever the placement; co-locating a subtree would save only the transfer
of its intermediate outputs (a few floats per row), not a round, unless a whole subtree ran
inside one actor call, which the pool's (key, rows) seam does not express.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from experts_store import ExpertRef, GraphBlock, Manifest, Pace, Store, no_pace, node_ref
from router import PrototypeTree
from server._exceptions import InvalidRequest
from server._settings import Settings
from server.kinds._grouping import group_positions
from server.kinds._types import GateRequest, ModelMismatch, ModelSection, Plan, PlannedGroup
from server.pool import GroupResult

__all__ = ["GraphModel", "GraphOptions", "GraphRouting"]

_MODES = ("tree", "exact")


@dataclass(frozen=True)
class GraphOptions:
    """A graph request's options: only the routing mode of every node's tree."""

    mode: str = "tree"


class GraphRouting:
    """Per row and node (in manifest node order): the global expert id (-1: not routed yet,
    or the row died upstream), the Euclidean distance from the node's input to that expert's
    prototype (0 where not routed), and the distance evaluations its tree walk cost."""

    def __init__(
        self,
        nodes: tuple[str, ...],
        experts: torch.Tensor,
        evals: torch.Tensor,
        mode: str,
        distances: torch.Tensor,
    ) -> None:
        self.nodes = nodes
        self.node_experts = experts  # [B, V] int64
        self.node_evals = evals  # [B, V] int64
        self.mode = mode
        self.node_distances = distances  # [B, V] float32

    @classmethod
    def empty(cls, nodes: tuple[str, ...], rows: int, mode: str) -> GraphRouting:
        shape = (rows, len(nodes))
        experts = torch.full(shape, -1, dtype=torch.int64)
        return cls(
            nodes, experts, torch.zeros(shape, dtype=torch.int64), mode,
            torch.zeros(shape, dtype=torch.float32),
        )

    @property
    def rows(self) -> int:
        return int(self.node_experts.shape[0])

    @property
    def experts(self) -> torch.Tensor:
        return self.node_experts

    @property
    def weights(self) -> torch.Tensor:
        # Each node's one expert has the whole weight within its node.
        return (self.node_experts >= 0).to(torch.float64)

    @property
    def distances(self) -> torch.Tensor:
        return self.node_distances

    @property
    def distance_evals(self) -> torch.Tensor:
        return self.node_evals.sum(dim=1)

    def slice(self, start: int, stop: int) -> GraphRouting:
        return GraphRouting(
            self.nodes, self.node_experts[start:stop], self.node_evals[start:stop], self.mode,
            self.node_distances[start:stop],
        )

    def per_node(self) -> dict[str, tuple[list[int], list[int]]]:
        """node -> (expert per row, distance evaluations per row)."""
        experts, evals = self.node_experts.T.tolist(), self.node_evals.T.tolist()
        return {n: (experts[v], evals[v]) for v, n in enumerate(self.nodes)}


@dataclass(frozen=True)
class _Node:
    name: str
    index: int  # column of the node in GraphRouting
    sources: tuple[tuple[str, int | None], ...]  # (source, column), "x" = the input
    tree: PrototypeTree
    experts: torch.Tensor  # [K_v] int64: prototype k -> global expert id
    output_dim: int


class GraphModel:
    """A store of kind "graph": its nodes (trees, experts) in topological waves."""

    kind = "graph"

    def __init__(
        self,
        graph: GraphBlock,
        trees: dict[str, PrototypeTree],
        experts: Sequence[ExpertRef],
        manifest: Manifest,
    ) -> None:
        self.graph = graph
        self.manifest = manifest
        self.experts = list(experts)
        self.nodes: dict[str, _Node] = {}
        for index, entry in enumerate(graph.nodes):
            tree = trees[entry.name]
            arity = sum(graph.width(r, manifest.input_dim, node=entry.name) for r in entry.inputs)
            if tree.num_prototypes != entry.num_experts or tree.dim != arity:
                raise ModelMismatch(
                    f"node {entry.name!r}: its router has {tree.num_prototypes} prototypes in "
                    f"{tree.dim} dims, the node {entry.num_experts} experts on {arity} inputs"
                )
            self.nodes[entry.name] = _Node(
                entry.name, index, tuple(node_ref(r) for r in entry.inputs), tree,
                torch.tensor(entry.experts, dtype=torch.int64), entry.output_dim,
            )
        self.names = tuple(entry.name for entry in graph.nodes)
        self.waves = graph.waves()
        self.outputs = tuple(node_ref(r) for r in graph.outputs)

    @classmethod
    def open(cls, store: Store, pace: Pace = no_pace) -> GraphModel:
        """Read every node's router (blocking); experts stay files until the pool loads them."""
        graph = store.manifest.graph
        if graph is None:
            raise ModelMismatch("a store of kind 'graph' without a graph block")
        trees = {n.name: PrototypeTree.load(store.node_router_path(n.name)) for n in graph.nodes}
        experts = store.expert_refs(pace)
        return cls(graph, trees, experts, store.manifest)

    @property
    def input_dim(self) -> int:
        return self.manifest.input_dim

    def prototypes(self) -> torch.Tensor | None:
        return None  # each node has its own, in its own space: see GET /v1/graph

    @property
    def routable_experts(self) -> int:
        return len(self.experts)  # every node's, each in its node's space

    def model_section(self) -> ModelSection:
        return ModelSection()  # the graph itself is GET /v1/graph's

    @property
    def beam_levels(self) -> int:
        return 1  # each node routes a row to one expert: no beam gate

    @property
    def options_taken(self) -> frozenset[str]:
        return frozenset({"mode"})  # each node's walk; one expert per node, no gate

    @property
    def max_distance_evals(self) -> int:
        """Σ_v ν_v·depth_v: the most a row's tree walks can cost."""
        return sum(node.tree.branching * node.tree.depth for node in self.nodes.values())

    def resolve(self, request: GateRequest, settings: Settings) -> GraphOptions:
        """Only `mode` applies: every node routes each row to exactly one expert."""
        if request.top_k not in (None, 1):
            raise InvalidRequest(
                "a graph store runs one expert per node per row: top_k must be 1", field="top_k"
            )
        for name in ("temperature", "min_weight", "top_p", "beam", "score"):
            if getattr(request, name) is not None:
                raise InvalidRequest(f"{name} does not apply to a graph store", field=name)
        mode = request.mode or settings.default_mode or self.manifest.routing
        options = GraphOptions(mode=mode)
        self.check(options)
        return options

    def check(self, options: Hashable) -> None:
        if not isinstance(options, GraphOptions):
            raise InvalidRequest("options of the wrong type for a graph store", field="gate")
        if options.mode not in _MODES:
            raise InvalidRequest(f"mode must be one of {_MODES}", field="mode")

    def node_inputs(self, node: _Node, x: torch.Tensor, values: dict[str, torch.Tensor]
                    ) -> torch.Tensor:
        """Node's input z [B, d_v] from x's columns and earlier nodes' outputs."""
        parts = []
        for source, column in node.sources:
            block = x if source == "x" else values[source]
            parts.append(block if column is None else block[:, column : column + 1])
        return torch.cat(parts, dim=1)

    def route_node(self, node: _Node, z: torch.Tensor, mode: str, routing: GraphRouting,
                   rows: torch.Tensor) -> None:
        """Route `rows` (their inputs z) through node's tree into `routing` (in place)."""
        if rows.numel() == 0:
            return
        result = node.tree.route(z, mode=mode)  # type: ignore[arg-type]
        routing.node_experts[rows, node.index] = node.experts[result.experts[:, 0]]
        routing.node_evals[rows, node.index] = result.distance_evals.to(torch.int64)
        routing.node_distances[rows, node.index] = result.distances[:, 0].to(torch.float32)

    def route(self, x: torch.Tensor, options: Hashable) -> GraphRouting:
        """Wave 0 (nodes reading only x); the run routes the later waves."""
        assert isinstance(options, GraphOptions)
        routing = GraphRouting.empty(self.names, int(x.shape[0]), options.mode)
        rows = torch.arange(x.shape[0])
        for name in self.waves[0]:
            node = self.nodes[name]
            self.route_node(node, self.node_inputs(node, x, {}), options.mode, routing, rows)
        return routing

    def concat(self, parts: list[Any]) -> GraphRouting:
        # Always new tensors: the run fills later waves in place.
        return GraphRouting(
            self.names,
            torch.cat([p.node_experts for p in parts]),
            torch.cat([p.node_evals for p in parts]),
            parts[0].mode,
            torch.cat([p.node_distances for p in parts]),
        )

    def start(self, x: torch.Tensor, routing: Any) -> _GraphRun:
        return _GraphRun(self, x, routing)

    def prefetch_keys(self, routing: Any) -> list[ExpertRef]:
        first = [self.nodes[n].index for n in self.waves[0]]
        ids = torch.unique(routing.node_experts[:, first])
        return [self.experts[int(e)] for e in ids.tolist() if e >= 0]


class _GraphRun:
    """One batch: one round per wave, then the graph's outputs gathered from the nodes'."""

    def __init__(self, model: GraphModel, x: torch.Tensor, routing: GraphRouting) -> None:
        self._model = model
        self._x = x
        self._routing = routing
        self._wave = 0
        self._alive = torch.ones(x.shape[0], dtype=torch.bool)
        self._values = {
            name: torch.zeros((x.shape[0], node.output_dim), dtype=torch.float32)
            for name, node in model.nodes.items()
        }
        self._out: torch.Tensor | None = None

    def plan(self) -> Plan | None:
        model = self._model
        if self._wave >= len(model.waves):
            return None
        live = torch.nonzero(self._alive).flatten()
        groups: list[PlannedGroup] = []
        for name in model.waves[self._wave]:
            node = model.nodes[name]
            upstream = {k: v[live] for k, v in self._values.items()}
            z = model.node_inputs(node, self._x[live], upstream)
            if self._wave > 0:
                model.route_node(node, z, self._routing.mode, self._routing, live)
            chosen = self._routing.node_experts[live, node.index]
            for expert, picks in group_positions(chosen):
                groups.append(PlannedGroup(
                    key=model.experts[int(expert)],
                    rows=live[picks],
                    weights=torch.ones(picks.numel(), dtype=torch.float64),
                    inputs=z[picks].contiguous(),
                    label=name,
                ))
        return Plan(groups)

    def combine(self, plan: Plan, results: Sequence[GroupResult]) -> None:
        for group, result in zip(plan.groups, results, strict=True):
            if result.error is not None:
                # Later waves skip these rows; the batcher fails the requests holding them.
                self._alive[group.rows] = False
                continue
            self._values[group.label][group.rows] = result.outputs.to(torch.float32)
        self._wave += 1

    @property
    def outputs(self) -> torch.Tensor:
        if self._wave < len(self._model.waves):
            raise RuntimeError("outputs asked before the last wave was combined")
        if self._out is None:
            parts = []
            for source, column in self._model.outputs:
                block = self._values[source]
                parts.append(block if column is None else block[:, column : column + 1])
            self._out = torch.cat(parts, dim=1)
        return self._out
