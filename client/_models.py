"""Typed answers of the v1 HTTP API (field names exactly as in docs/CONTRACTS.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ActorInfo",
    "ExpertInfo",
    "ExpertPatches",
    "ExpertStat",
    "ExpertsInfo",
    "GeneratedExpert",
    "GraphInfo",
    "GraphNode",
    "GraphStats",
    "ModelInfo",
    "PredictStats",
    "Prediction",
    "Routing",
]


class _Model(BaseModel):
    # Unknown fields are ignored so that a newer server with extra fields still decodes.
    model_config = ConfigDict(extra="ignore", frozen=True)


class ExpertStat(_Model):
    """What one expert cost this request."""

    expert_id: int
    rows: int
    cache: Literal["hit", "miss"]
    load_ms: float
    compute_ms: float
    actor: str
    expert_bytes: int
    activation_bytes: int
    vram_bytes: int
    key: str | None = None  # kind hyper: the condition's cache key
    generator_bytes: int = 0  # kind hyper: the pinned hypernetwork's bytes
    node: str | None = None  # kind graph: the node this expert served
    wave: int | None = None  # kind graph: the wave it ran in


class GraphStats(_Model):
    """Kind graph: `PredictStats.graph`. The request's `vram_bytes` is the sum over nodes of
    each node's largest expert with its activations; `wave_vram_bytes` the same per wave."""

    waves: int
    wave_vram_bytes: list[int]
    peak_wave_vram_bytes: int
    node_distance_evals: dict[str, list[int]]  # node -> per row


class PredictStats(_Model):
    """`stats` of a prediction asked with `return_stats=True`."""

    experts: list[ExpertStat]
    vram_bytes: int
    device_bytes: dict[str, int] = Field(default_factory=dict)
    distance_evals: list[int] = Field(default_factory=list)
    route_ms: float = 0.0
    queue_ms: float = 0.0
    total_ms: float = 0.0
    patches_computed: int | None = None  # pmoe stores: patch computations made
    patches_dense: int | None = None  # pmoe stores: rows·n·k
    graph: GraphStats | None = None  # graph stores: waves, VRAM per wave, evaluations per node

    @property
    def hits(self) -> int:
        return sum(1 for stat in self.experts if stat.cache == "hit")

    @property
    def misses(self) -> int:
        return sum(1 for stat in self.experts if stat.cache == "miss")


class ExpertPatches(_Model):
    """pmoe stores: the patches one expert took for one row, and their gates."""

    expert_id: int
    patches: list[int]
    gates: list[float]


class Prediction(_Model):
    """`POST /v1/predict`: one output row per input row, in input order."""

    outputs: list[list[float]]
    experts: list[list[int]]
    weights: list[list[float]]
    store_version: str
    stats: PredictStats | None = None
    patches: list[list[ExpertPatches]] | None = None  # with return_routing (pmoe stores)
    nodes: dict[str, list[int]] | None = None  # graph stores: node -> its expert for each row

    def numpy(self) -> Any:
        """The outputs as a float32 numpy array [rows, output_dim] (needs numpy)."""
        return _as_array(self.outputs, "float32")

    def experts_numpy(self) -> Any:
        """The experts as an int64 numpy array [rows, top_k] (needs numpy)."""
        return _as_array(self.experts, "int64")


class Routing(_Model):
    """`POST /v1/route`: where each row goes; nothing is loaded."""

    experts: list[list[int]]
    weights: list[list[float]]
    distances: list[list[float]]
    distance_evals: list[int]
    store_version: str
    patches: list[list[ExpertPatches]] | None = None  # pmoe stores

    def numpy(self) -> Any:
        """The experts as an int64 numpy array [rows, top_k] (needs numpy)."""
        return _as_array(self.experts, "int64")


class ModelInfo(_Model):
    """`GET /v1/model`: the manifest summary (prototypes only when asked for)."""

    store_version: str
    format_version: int
    task: str
    input_dim: int
    output_dim: int
    num_experts: int
    branching: int
    routing: str
    temperature: float
    total_expert_bytes: int
    max_expert_bytes: int
    total_params: int
    prototypes: list[list[float]] | None = None
    kind: str = "momlp"
    hyper: dict[str, Any] | None = None  # kind hyper: condition_dim, theta_bytes, ...
    gate: dict[str, Any] | None = None  # the store's default gate: score, temperature, ...
    pmoe: dict[str, Any] | None = None  # kind pmoe: patch layout, routing, gating


class GraphNode(_Model):
    """One node of a graph store (`GET /v1/graph`)."""

    name: str
    inputs: list[str]  # "x:i" (input column i) or another node's name
    output_dim: int
    num_experts: int  # K_v
    branching: int
    experts: list[int]  # global expert ids, in the node's prototype order
    bytes: int  # all K_v experts' files
    max_expert_bytes: int
    device_bytes: int  # all K_v experts once loaded
    max_expert_device_bytes: int  # what one row needs of this node
    wave: int


class GraphInfo(_Model):
    """`GET /v1/graph`: a graph store's nodes, edges and waves (404 NotFound on other kinds)."""

    store_version: str
    input_dim: int
    output_dim: int
    outputs: list[str]
    waves: list[list[str]]
    nodes: list[GraphNode]
    edges: list[tuple[str, str]]  # (source, node)
    total_expert_bytes: int
    total_expert_device_bytes: int
    one_expert_per_node_device_bytes: int
    max_distance_evals: int


class GeneratedExpert(_Model):
    """`POST /v1/generate` (kind hyper): θ for one condition as a store expert file."""

    data: bytes  # the safetensors file, as `experts_store.load_expert` reads it
    key: str  # the condition's cache key (X-Momlp-Key)
    store_version: str  # the version that generated it (X-Momlp-Store-Version)


class ExpertInfo(_Model):
    id: int
    bytes: int
    params: int
    actors: list[str]


class ActorInfo(_Model):
    name: str
    device: str
    resident_bytes: int
    budget_bytes: int
    resident: list[int]
    alive: bool
    # Alive but passed over until it answers a health check (servers before 2026-12-02 omit it).
    suspect: bool = False


class ExpertsInfo(_Model):
    """`GET /v1/experts`: each expert and which actors hold it now."""

    experts: list[ExpertInfo]
    actors: list[ActorInfo]


def _as_array(values: list[list[float]] | list[list[int]], dtype: str) -> Any:
    try:
        import numpy as np
    except ImportError as exc:
        raise ImportError("numpy is not installed; use the list fields instead") from exc
    return np.asarray(values, dtype=dtype)
