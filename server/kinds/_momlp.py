"""Kind "momlp": a flat mixture of expert MLPs routed by a prototype tree (one round).

Plan: the gate (`router.Gate`, the store's defaults overridden by the request within the
server's caps) gives each row its experts and weights; each distinct expert is one group.
Combine: each row's weighted sum in float64 over its experts, in expert-id order whatever
the batch, so a row's output never depends on its neighbours.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

from experts_store import ExpertRef, GateSpec, Manifest, ManifestError, Pace, Store, no_pace
from router import (
    Gate,
    GateRouting,
    LinearGateRouter,
    PrototypeTree,
    RouterInputError,
    check_gate,
)
from server._exceptions import CapExceeded, InvalidRequest
from server._settings import Settings
from server.kinds._grouping import sorted_groups
from server.kinds._one_round import OneRoundRun
from server.kinds._types import (
    GATE_OPTIONS,
    GateRequest,
    ModelMismatch,
    ModelSection,
    Plan,
    PlannedGroup,
)
from server.pool import GroupResult

__all__ = ["GateRouter", "MomlpModel"]


class GateRouter(Protocol):
    """What the kind needs of `router.PrototypeTree`."""

    @property
    def num_prototypes(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def depth(self) -> int: ...
    def gate(self, x: Any, gate: Gate) -> GateRouting: ...


class MomlpModel:
    """A store of kind "momlp": its router, its experts and its default gate."""

    kind = "momlp"

    def __init__(
        self,
        router: GateRouter,
        experts: Sequence[ExpertRef],
        manifest: Manifest | None = None,
        *,
        gate: GateSpec | None = None,
    ) -> None:
        if len(experts) != router.num_prototypes:
            raise ModelMismatch(
                f"{len(experts)} experts for a router of {router.num_prototypes} prototypes"
            )
        self.router = router
        self.experts = list(experts)
        self.manifest = manifest
        self.gate_spec = gate or (manifest.gate_spec if manifest is not None else GateSpec())
        self.default_mode: str = manifest.routing if manifest is not None else "tree"
        # A learned linear gate's prototypes are lifted router rows (router/_lift.py): rows
        # are lifted to [x, 1, 0, 0] before routing (by LinearGateRouter), so exact routing
        # serves the linear softmax exactly; its dim is the rows', not the lifted tree's.
        self._lifted = self.gate_spec.lift == "linear"

    @classmethod
    def open(cls, store: Store, pace: Pace = no_pace) -> MomlpModel:
        """Read the store's router (blocking); experts stay files until the pool loads them."""
        router: GateRouter = PrototypeTree.load(store.router_path)
        if store.manifest.gate_spec.lift == "linear":
            # Takes input-space rows and lifts them itself; exact top-k by logit bounds.
            router = LinearGateRouter(router)
        if router.dim != store.manifest.input_dim:
            # Else every request is refused by one check or the other (the router's columns,
            # the manifest's): a store that cannot answer anything must not go live.
            raise ManifestError(
                root=store.root,
                message=f"the router's prototypes have dimension {router.dim}, the manifest's "
                f"input_dim is {store.manifest.input_dim}",
            )
        experts = store.expert_refs(pace)
        return cls(router, experts, store.manifest)

    @property
    def input_dim(self) -> int:
        return self.router.dim

    def prototypes(self) -> torch.Tensor | None:
        if self._lifted:
            return None  # lifted router rows, not points of the input space
        return getattr(self.router, "prototypes", None)

    @property
    def num_experts(self) -> int:
        return self.router.num_prototypes

    @property
    def routable_experts(self) -> int:
        return self.num_experts

    @property
    def beam_levels(self) -> int:
        return max(1, self.router.depth)

    @property
    def options_taken(self) -> frozenset[str]:
        return GATE_OPTIONS  # every gate option; no conditions

    def model_section(self) -> ModelSection:
        return ModelSection()

    def resolve(self, request: GateRequest, settings: Settings) -> Gate:
        """The request's gate: its fields over the store's gate, within the server's caps."""
        spec = self.gate_spec
        if request.top_k is None and request.beam is not None:
            # A beam's last width is how many experts a row keeps, and beam excludes top_k > 1:
            # the server's default top_k is for flat gates (a 422 would blame a top_k the
            # client never sent).
            k = 1
        elif request.top_k is None:
            # The server's default is for every store it may serve; a store of fewer experts
            # has all of them as its top-k (a 422 would blame a value the client never sent).
            k = min(settings.default_top_k, self.num_experts)
        else:
            k = request.top_k
        if k > self.num_experts:
            raise InvalidRequest(
                f"top_k={k} exceeds the {self.num_experts} experts of this model", field="top_k"
            )
        if k > settings.max_top_k:
            raise CapExceeded(cap="max_top_k", limit=settings.max_top_k, value=k, field="top_k")
        beam = request.beam
        if beam is not None:
            widest = max(beam, default=0)
            if widest > settings.max_beam:
                raise CapExceeded(
                    cap="max_beam", limit=settings.max_beam, value=list(beam), field="beam"
                )
            if len(beam) > self.beam_levels:
                raise InvalidRequest(
                    f"beam has {len(beam)} widths, the tree has {self.router.depth} levels",
                    field="beam",
                )
        tau = request.temperature if request.temperature is not None else spec.temperature
        ratio = settings.max_temperature_ratio
        low, high = spec.temperature / ratio, spec.temperature * ratio
        if not low <= tau <= high:
            raise CapExceeded(
                cap="max_temperature_ratio", limit=ratio, value=tau, field="temperature",
                allowed=f"[{low:.6g}, {high:.6g}], the store's τ={spec.temperature:.6g}"
                f" divided or multiplied by the cap",
            )
        mode = request.mode or settings.default_mode or self.default_mode
        gate = Gate(
            top_k=k,
            mode=mode,  # type: ignore[arg-type]
            temperature=float(tau),
            score=(request.score or spec.score),  # type: ignore[arg-type]
            min_weight=request.min_weight if request.min_weight is not None else 0.0,
            top_p=request.top_p if request.top_p is not None else 1.0,
            beam=tuple(beam) if beam is not None else None,
            tree_top_k=spec.tree_top_k,
        )
        self.check(gate)
        return gate

    def check(self, options: Hashable) -> None:
        if not isinstance(options, Gate):
            raise InvalidRequest("gate options of the wrong type", field="gate")
        try:
            check_gate(options, self.num_experts)
        except RouterInputError as exc:
            raise InvalidRequest(str(exc), field=getattr(exc, "field", "gate")) from exc

    def route(self, x: torch.Tensor, options: Hashable) -> GateRouting:
        assert isinstance(options, Gate)
        return self.router.gate(x, options)

    def concat(self, parts: list[Any]) -> GateRouting:
        return GateRouting.concat(parts)

    def start(self, x: torch.Tensor, routing: Any) -> _MomlpRun:
        return _MomlpRun(x, routing, self.experts)

    def prefetch_keys(self, routing: Any) -> list[ExpertRef]:
        ids = torch.unique(routing.experts[routing.experts >= 0]).tolist()
        return [self.experts[int(e)] for e in ids]


class _MomlpRun(OneRoundRun):
    """One batch: one round of groups (one per distinct expert), then the weighted sums."""

    def __init__(self, x: torch.Tensor, routing: GateRouting, experts: list[ExpertRef]) -> None:
        super().__init__()
        self._x = x
        self._routing = routing
        self._experts = experts

    def _groups(self) -> list[PlannedGroup]:
        experts, weights = self._routing.experts, self._routing.weights
        ids, pairs, counts = sorted_groups(experts.reshape(-1))
        # Pair p is row p // width's choice; one gather each for rows, weights and inputs,
        # then a view per group (a batch has tens of groups: per-group gathers add up).
        rows = torch.div(pairs, experts.shape[1], rounding_mode="floor")
        every = zip(
            ids,
            torch.split(rows, counts),
            torch.split(weights.reshape(-1)[pairs], counts),
            torch.split(self._x[rows], counts),
            strict=True,
        )
        return [
            PlannedGroup(key=self._experts[e], rows=r, weights=w, inputs=x)
            for e, r, w, x in every
        ]

    def _combine(self, plan: Plan, results: Sequence[GroupResult]) -> torch.Tensor:
        good = [(g, r) for g, r in zip(plan.groups, results, strict=True) if r.error is None]
        out_dim = int(good[0][1].outputs.shape[1]) if good else 0
        # Float64 sums in group (expert id) order: the same additions for a row whatever
        # else is in its batch; a weight of 1.0 gives the expert's float32 output exactly.
        out = torch.zeros((self._x.shape[0], out_dim), dtype=torch.float64)
        if good:
            # One index_add_ over the groups laid end to end adds each row's contributions in
            # the same (group) order as one call per group would, with a handful of ops per
            # batch instead of three per group.
            rows = torch.cat([group.rows for group, _ in good])
            weights = torch.cat([group.weights for group, _ in good])
            outputs = torch.cat([result.outputs for _, result in good])
            out.index_add_(0, rows, outputs.to(torch.float64) * weights[:, None])
        return out.to(torch.float32)
