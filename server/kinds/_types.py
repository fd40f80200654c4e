"""The store-kind seam: what a kind plans for the pool and how it combines the answers.

Serving a batch is plan → pool → combine, repeated while the kind has rounds left (one for a
flat mixture; one per topological wave for a graph of mixtures). A plan is a list of groups:
a cache key the pool leases (an `ExpertRef` today; any content-addressed key later), the
batch rows it serves, each row's gate weight, and the inputs the expert computes on (the
rows themselves, a node's upstream outputs, or a sample's patches). Prefetch, spill, stats and
VRAM accounting all work on groups, so a new kind gets them without touching the batcher.

Records built per group or per request (`PlannedGroup`) are plain dataclasses, not frozen: a
frozen dataclass sets each field through `object.__setattr__`, about a microsecond more per
record, and a 16-request batch builds ~200 of them (6 % of the server's own path, measured by
`benchmarks/server_path.py`). Nothing changes one after it is built.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from experts_store import ExpertRef, PMoESpec
from server._settings import Settings
from server.pool import Group, GroupResult

__all__ = [
    "GATE_OPTIONS",
    "REQUEST_OPTIONS",
    "BatchRun",
    "ConditionRequest",
    "GateRequest",
    "HyperSection",
    "ModelMismatch",
    "ModelSection",
    "Plan",
    "PlannedGroup",
    "RowRouting",
    "ServedModel",
]


class ModelMismatch(ValueError):
    """A kind's parts do not fit together (a router of K prototypes for K+1 experts). Read
    from a store, the store's fault: `open_model` reports it as StoreNotServable. A
    ValueError to whoever builds a model by hand (tests, benchmarks); any other ValueError
    from an opener is a defect and keeps its traceback."""


@dataclass(frozen=True)
class GateRequest:
    """A request's gate options as the HTTP floor parsed them (None: the store's default)."""

    top_k: int | None = None
    mode: str | None = None
    temperature: float | None = None
    min_weight: float | None = None
    top_p: float | None = None
    beam: tuple[int, ...] | None = None
    score: str | None = None


@dataclass(frozen=True)
class ConditionRequest:
    """A request's conditions as the HTTP floor parsed them: at most one field is set."""

    conditions: list[list[float]] | None = None  # one per row
    condition: list[float] | None = None  # one for every row
    condition_ids: list[str] | None = None  # one named condition per row

    @property
    def given(self) -> str | None:
        """The name of the field the request used, or None."""
        for name in ("conditions", "condition", "condition_ids"):
            if getattr(self, name) is not None:
                return name
        return None


# What a request may set beyond its rows, by name: GateRequest's fields, and "conditions" for
# the three ways of giving a row's condition (conditions, condition, condition_ids).
REQUEST_OPTIONS = frozenset(
    {"top_k", "mode", "temperature", "min_weight", "top_p", "beam", "score", "conditions"}
)
GATE_OPTIONS = frozenset({"top_k", "mode", "temperature", "min_weight", "top_p", "beam", "score"})


@dataclass(frozen=True)
class HyperSection:
    """A hyper store's generator as GET /v1/model shows it: what a cached θ and f weigh."""

    condition_dim: int
    theta_bytes: int  # |θ|: one generated expert as the cache holds it
    generator_bytes: int  # |f|: the hypernetwork's weights
    primary_widths: list[int]
    condition_source: str
    condition_ids: list[str]  # the named conditions (the first 1,000)


@dataclass(frozen=True)
class ModelSection:
    """A kind's own fields of GET /v1/model, beside those every manifest has: each kind sets
    its own (if any), so the HTTP floor shows them without asking which kind it serves."""

    pmoe: PMoESpec | None = None
    hyper: HyperSection | None = None


@dataclass  # not frozen: built per group or per request (module docstring)
class PlannedGroup:
    """The rows of one batch that one cache key serves in one round."""

    key: ExpertRef
    rows: torch.Tensor  # [m] int64: batch rows, each once per group
    weights: torch.Tensor  # [m] float64: the gate weight of the key for each row
    inputs: torch.Tensor  # [m, d] float32: what the expert computes on
    label: str = ""  # where in the model the key serves (a graph's node name; "" for momlp)

    def group(self) -> Group:
        return Group(expert=self.key, rows=self.inputs)


@dataclass(frozen=True)
class Plan:
    """One round of pool work."""

    groups: list[PlannedGroup]

    def pool_groups(self) -> list[Group]:
        return [g.group() for g in self.groups]


class RowRouting(Protocol):
    """Where each row of some rows goes: computed row by row, so slicing a batch's routing
    gives each request's, and concatenating requests' routings gives the batch's."""

    @property
    def rows(self) -> int: ...
    @property
    def experts(self) -> torch.Tensor: ...  # [B, L] int64, -1 = none
    @property
    def weights(self) -> torch.Tensor: ...  # [B, L] float64
    @property
    def distances(self) -> torch.Tensor: ...  # [B, L] float32
    @property
    def distance_evals(self) -> torch.Tensor: ...  # [B] int64
    def slice(self, start: int, stop: int) -> RowRouting: ...


class BatchRun(Protocol):
    """One batch of one kind, from its routing to its outputs."""

    def plan(self) -> Plan | None:
        """The next round of groups, or None when the outputs are complete."""
        ...

    def combine(self, plan: Plan, results: Sequence[GroupResult]) -> None:
        """Take one round's results (same order as `plan.groups`; failed ones left out)."""
        ...

    @property
    def outputs(self) -> torch.Tensor:  # [B, out] float32, rows in input order
        ...


class ServedModel(Protocol):
    """One store version of one kind, as the batching floor serves it."""

    kind: str
    experts: list[ExpertRef]  # indexed by expert id

    def prototypes(self) -> torch.Tensor | None:
        """The routing prototypes [K, n] to show in /v1/model, if the kind has them."""
        ...

    @property
    def input_dim(self) -> int: ...

    @property
    def routable_experts(self) -> int:
        """How many experts a row can be routed to (GET /v1/model's `num_experts`): the
        expert files, or a kind's generated experts (a prototype-conditioned hyper store's K
        prototypes, each served by θ = f(p_k) with no file)."""
        ...

    def model_section(self) -> ModelSection:
        """The kind's own fields of GET /v1/model (none for a kind without any)."""
        ...

    @property
    def beam_levels(self) -> int:
        """The most widths a request's `beam` may give, as /openapi.json states it: the levels
        of the prototype tree a beam gate walks, 1 for a kind without one."""
        ...

    @property
    def options_taken(self) -> frozenset[str]:
        """Which of `REQUEST_OPTIONS` a request may set for this store; `resolve` refuses the
        others, and /openapi.json leaves them out (top_k = 1 every kind takes)."""
        ...

    def resolve(self, request: GateRequest, settings: Settings) -> Hashable:
        """The request's options against the store's defaults and the server's caps
        (InvalidRequest, CapExceeded); the result is hashable: requests merge by it."""
        ...

    def check(self, options: Hashable) -> None:
        """InvalidRequest if `options` cannot be served by this store."""
        ...

    def route(self, x: torch.Tensor, options: Hashable) -> RowRouting:
        """Route float32 rows [B, n] (blocking CPU work; RouterInputError for bad rows)."""
        ...

    def concat(self, parts: list[RowRouting]) -> RowRouting: ...

    def start(self, x: torch.Tensor, routing: RowRouting) -> BatchRun: ...

    def prefetch_keys(self, routing: RowRouting) -> list[ExpertRef]:
        """The keys the first round of these rows will need."""
        ...
