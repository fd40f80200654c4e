"""Pydantic v2 models of the HTTP JSON (v1) shapes; field names are shared with `client`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from experts_store import GateSpec, PMoESpec

__all__ = [
    "ActorInfoModel",
    "GateModel",
    "ErrorBody",
    "ErrorResponse",
    "ExpertInfoModel",
    "ExpertPatchesModel",
    "ExpertStatModel",
    "ExpertsResponse",
    "GateQuery",
    "GraphStatsModel",
    "HealthResponse",
    "HyperSummary",
    "ModelResponse",
    "PredictRequest",
    "PredictResponse",
    "PredictStats",
    "ReadyResponse",
    "RouteRequest",
    "RouteResponse",
]

# Strict so that "1.5" or true is refused rather than coerced; NaN/Inf are refused here
# because a non-finite input would only come back as a non-finite output.
FiniteNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def _integral(value: object) -> object:
    # JSON Schema's "integer" includes 5.0; "1.5", true and "5" stay refused (strict below).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


ConditionId = Annotated[str, Field(min_length=1, max_length=128)]
PositiveWhole = Annotated[int, Field(strict=True, ge=1), BeforeValidator(_integral)]
Mode = Literal["tree", "exact"]
# A gate's bounds, one statement for its JSON field (GateModel) and its query parameter
# (GateQuery). Lax, so that a query string's "0.5" parses.
Temperature = Annotated[float, Field(gt=0, allow_inf_nan=False)]
MinWeight = Annotated[float, Field(ge=0, lt=1)]
TopP = Annotated[float, Field(gt=0, le=1)]
Score = Literal["sqdist", "dist"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GateModel(_Strict):
    """Request-time gate; every field defaults to the store's gate (manifest `gate`).

    Its numbers are strict, as the body's other numbers: "0.5" or true is refused, not coerced.
    """

    temperature: Annotated[Temperature, Field(strict=True)] | None = Field(
        default=None, description="τ of softmax(-score/τ)"
    )
    min_weight: Annotated[MinWeight, Field(strict=True)] | None = Field(
        default=None, description="drop experts below this weight, renormalise"
    )
    top_p: Annotated[TopP, Field(strict=True)] | None = Field(
        default=None, description="keep the smallest prefix reaching p, renormalise"
    )
    beam: list[PositiveWhole] | None = Field(
        default=None,
        min_length=1,
        description="hierarchical gate: beam width per tree level (a shorter list reuses its"
        " last width); all 1 is mode=tree",
    )
    score: Score | None = Field(
        default=None, description="softmax over -d² (sqdist) or -d (dist, the paper's eq. 39)"
    )


class RouteRequest(_Strict):
    """Rows to route; every row must have the store's input dimension."""

    inputs: list[list[FiniteNumber]] = Field(min_length=1)
    top_k: PositiveWhole | None = Field(default=None, description="default 1")
    mode: Mode | None = Field(default=None, description="default: the store's routing mode")
    gate: GateModel | None = Field(default=None, description="default: the store's gate")
    conditions: list[list[FiniteNumber]] | None = Field(
        default=None, description="kind hyper: one condition per row"
    )
    condition: list[FiniteNumber] | None = Field(
        default=None, description="kind hyper: one condition for every row"
    )
    condition_ids: list[ConditionId] | None = Field(
        default=None, description="kind hyper: named conditions of the store, one per row or "
        "one for all"
    )


class PredictRequest(RouteRequest):
    """Rows to predict; `top_k > 1` returns the gate-weighted sum of the k nearest experts."""

    return_stats: bool = Field(default=False, strict=True)
    return_routing: bool = Field(
        default=False,
        strict=True,
        description="pmoe stores: add `patches`, each expert's patches and gates per row "
        "(other kinds: `patches` stays null)",
    )


class GateQuery(BaseModel):
    """The query string of /v1/predict and /v1/route: a binary body's gate and what to return.

    A JSON body carries its own (`PredictRequest`); a query beside it is checked but not used,
    as each parameter's description says. An unknown parameter is refused (a misspelt option
    would otherwise be ignored). Values arrive as strings, so numbers and booleans are parsed
    leniently ("3", "true").
    """

    model_config = ConfigDict(extra="forbid")

    top_k: int | None = Field(default=None, ge=1, description="binary bodies only")
    mode: Mode | None = Field(default=None, description="binary bodies only")
    temperature: Temperature | None = Field(default=None, description="binary bodies only")
    min_weight: MinWeight | None = Field(default=None, description="binary bodies only")
    top_p: TopP | None = Field(default=None, description="binary bodies only")
    beam: str | None = Field(
        default=None,
        pattern=r"^[1-9][0-9]{0,5}(,[1-9][0-9]{0,5}){0,63}$",
        description="binary bodies only: widths per level, comma-separated (2,2,2)",
    )
    score: Score | None = Field(default=None, description="binary bodies only")
    return_stats: bool = Field(default=False, description="binary bodies only")
    return_routing: bool = Field(
        default=False, description="binary bodies only; pmoe stores"
    )


class ExpertStatModel(BaseModel):
    expert_id: int
    rows: int
    cache: Literal["hit", "miss"]
    load_ms: float
    compute_ms: float
    actor: str
    expert_bytes: int
    activation_bytes: int
    vram_bytes: int
    key: str | None = Field(
        default=None, description="kind hyper: the condition's cache key (cache, load_ms: "
        "whether θ was generated for this request and how long it took)"
    )
    generator_bytes: int = Field(default=0, description="kind hyper: bytes of the pinned f")
    node: str | None = None  # graph stores: the node this expert served, in wave `wave`
    wave: int | None = None


class GraphStatsModel(BaseModel):
    """Graph stores: `vram_bytes` (above) is the sum over nodes of each node's largest
    expert with its activations; `wave_vram_bytes` the same per wave (its peak: the largest)."""

    waves: int
    wave_vram_bytes: list[int]
    peak_wave_vram_bytes: int
    node_distance_evals: dict[str, list[int]]  # node -> per row


class PredictStats(BaseModel):
    experts: list[ExpertStatModel]
    vram_bytes: int
    device_bytes: dict[str, int]
    distance_evals: list[int]
    route_ms: float
    queue_ms: float
    total_ms: float
    patches_computed: int | None = Field(
        default=None, description="pmoe: patch computations made (sum of the experts' rows)"
    )
    patches_dense: int | None = Field(
        default=None, description="pmoe: rows·n·k, what every expert on every patch would make"
    )
    graph: GraphStatsModel | None = None


class ExpertPatchesModel(BaseModel):
    """One expert's patches for one row (indices 0..n-1, in the order it took them)."""

    expert_id: int
    patches: list[int]
    gates: list[float]


class PredictResponse(BaseModel):
    """`experts` / `weights`: each row's kept experts, heaviest first (rows may differ in
    length under min_weight / top_p)."""

    outputs: list[list[float]]
    experts: list[list[int]]
    weights: list[list[float]]
    store_version: str
    stats: PredictStats | None = None
    patches: list[list[ExpertPatchesModel]] | None = None
    nodes: dict[str, list[int]] | None = None  # graph stores: node -> expert per row


class RouteResponse(BaseModel):
    experts: list[list[int]]
    weights: list[list[float]]
    distances: list[list[float]]
    distance_evals: list[int]
    store_version: str
    patches: list[list[ExpertPatchesModel]] | None = None


class HyperSummary(BaseModel):
    """A hyper store's generator: what a cached expert θ and the generator f weigh."""

    condition_dim: int
    theta_bytes: int = Field(description="|θ|: one generated expert as the cache holds it")
    generator_bytes: int = Field(description="|f|: the hypernetwork's weights")
    primary_widths: list[int]
    condition_source: str
    condition_ids: list[str] = Field(description="the named conditions (the first 1,000)")


class ModelResponse(BaseModel):
    store_version: str
    format_version: int
    task: Literal["regression", "classification"]
    input_dim: int
    output_dim: int
    num_experts: int
    branching: int
    routing: Mode
    temperature: float
    kind: str = "momlp"
    gate: GateSpec | None = Field(default=None, description="the store's default gate")
    pmoe: PMoESpec | None = Field(
        default=None, description="kind pmoe: patch layout (n, d, image), routing, gating"
    )
    total_expert_bytes: int
    max_expert_bytes: int
    total_params: int
    prototypes: list[list[float]] | None = None
    hyper: HyperSummary | None = Field(default=None, description="kind hyper")


class ExpertInfoModel(BaseModel):
    id: int
    bytes: int
    params: int
    actors: list[str]


class ActorInfoModel(BaseModel):
    name: str
    device: str
    resident_bytes: int
    budget_bytes: int
    resident: list[int]
    alive: bool
    # Alive but passed over: it left a health check unanswered (momlp_actor_suspect).
    suspect: bool = False


class ExpertsResponse(BaseModel):
    experts: list[ExpertInfoModel]
    actors: list[ActorInfoModel]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    store_version: str


class ErrorBody(BaseModel):
    code: str
    message: str
    detail: Any = None


class ErrorResponse(BaseModel):
    error: ErrorBody
