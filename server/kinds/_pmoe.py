"""Kind "pmoe": patch-level routing (paper 003). Each input is n patches of d values.

Route: expert choice scores every (expert s, patch j) as <w_s, x^(j)> and gives expert s the l
patches with the largest scores, ties to the lowest index (a stable descending sort); token
choice sends each patch to its nearest prototype's expert through the store's prototype tree.
Each (row, slot) pair is one patch computation: slots are (expert, rank) for expert choice,
patch positions for token choice.
Plan: one round; every patch of every row of the batch that expert s took forms expert s's
group (a row appears in the group once per patch it gave s: `PlannedGroup.rows` repeats).
Combine: each patch's expert output times its gate, in float64, summed per row in slot order,
so a row's output never depends on which rows share its batch.

`PatchRouting` and expert choice's router live in `_pmoe_routing`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from experts_store import ExpertRef, Pace, PMoESpec, Store, no_pace
from router import PrototypeTree
from server._exceptions import InvalidRequest
from server._settings import Settings
from server.kinds._grouping import group_positions
from server.kinds._one_round import OneRoundRun
from server.kinds._pmoe_routing import (
    PatchRouting,
    expert_summary,
    read_router_weight,
    router_scores,
)
from server.kinds._types import GateRequest, ModelMismatch, ModelSection, Plan, PlannedGroup
from server.pool import GroupResult

__all__ = ["PatchModel", "PatchOptions", "PatchRouting"]


@dataclass(frozen=True)
class PatchOptions:
    """A pmoe request's resolved options (requests merge by them)."""

    mode: Literal["tree", "exact"] | None = None  # token choice: how the tree is walked


class PatchModel:
    """A store of kind "pmoe": its patch layout, its router and its per-patch experts."""

    kind = "pmoe"

    def __init__(
        self,
        spec: PMoESpec,
        experts: Sequence[ExpertRef],
        *,
        router_weight: torch.Tensor | None = None,
        tree: PrototypeTree | None = None,
        default_mode: Literal["tree", "exact"] = "tree",
    ) -> None:
        self.spec = spec
        self.experts = list(experts)
        self.router_weight = router_weight
        self.tree = tree
        self.default_mode = default_mode
        k = len(self.experts)
        d = spec.layout.patch_dim
        if spec.routing == "expert_choice":
            if router_weight is None or tuple(router_weight.shape) != (k, d):
                got = "none" if router_weight is None else list(router_weight.shape)
                raise ModelMismatch(
                    f"expert choice over {k} experts of patches of {d} needs a [{k}, {d}] "
                    f"router, got {got}"
                )
        elif tree is None or tree.num_prototypes != k or tree.dim != d:
            got = "none" if tree is None else f"{tree.num_prototypes} in R^{tree.dim}"
            raise ModelMismatch(
                f"token choice over {k} experts of patches of {d} needs a tree of {k} "
                f"prototypes in R^{d}, got {got}"
            )

    @classmethod
    def open(cls, store: Store, pace: Pace = no_pace) -> PatchModel:
        """Read the store's router file (blocking); experts stay files until the pool loads."""
        manifest = store.manifest
        if manifest.pmoe is None:
            raise ModelMismatch("a pmoe store without its pmoe block")
        experts = store.expert_refs(pace)
        if manifest.pmoe.routing == "token_choice":
            tree = PrototypeTree.load(store.router_path)
            return cls(manifest.pmoe, experts, tree=tree, default_mode=manifest.routing)
        weight = read_router_weight(store.router_path)
        return cls(manifest.pmoe, experts, router_weight=weight)

    @property
    def input_dim(self) -> int:
        return self.spec.layout.input_dim

    @property
    def routable_experts(self) -> int:
        return len(self.experts)

    def model_section(self) -> ModelSection:
        return ModelSection(pmoe=self.spec)

    @property
    def beam_levels(self) -> int:
        return 1  # patches are routed by expert or token choice: no beam gate

    @property
    def options_taken(self) -> frozenset[str]:
        # No gate; a token-choice store's walk has a mode, expert choice has none.
        return frozenset({"mode"}) if self.spec.routing == "token_choice" else frozenset()

    @property
    def num_patches(self) -> int:
        return self.spec.layout.num_patches

    @property
    def patch_dim(self) -> int:
        return self.spec.layout.patch_dim

    @property
    def image_shape(self) -> tuple[int, int, int] | None:
        image = self.spec.layout.image
        return image.shape if image is not None else None

    def image_rows(self, images: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """[B, H, W, C] -> [B, n·d]: ph x pw patches, row-major over the grid, each flattened
        (row, column, channel) — `trainer.pmoe.image_to_patches`' order."""
        image = self.spec.layout.image
        if image is None or tuple(images.shape[1:]) != image.shape:
            raise InvalidRequest(
                f"images must be [B, {', '.join(map(str, self.image_shape or ()))}]",
                field="inputs",
            )
        (rows, cols), (ph, pw) = image.grid, (image.patch_height, image.patch_width)
        b, c = images.shape[0], image.channels
        grid = images.reshape(b, rows, ph, cols, pw, c).transpose(0, 1, 3, 2, 4, 5)
        return np.ascontiguousarray(grid.reshape(b, self.input_dim))

    def prototypes(self) -> torch.Tensor | None:
        # /v1/model shows prototypes of the input space; these live in patch space.
        return None

    def resolve(self, request: GateRequest, settings: Settings) -> PatchOptions:
        """Patch routing has no gate knobs; a request that sets one is refused, naming it
        (top_k=1, which the SDK always sends, means the default and is accepted)."""
        if request.top_k not in (None, 1):
            raise InvalidRequest(
                "top_k does not apply to a pmoe store (each expert takes its top-l patches)",
                field="top_k",
            )
        for name in ("temperature", "min_weight", "top_p", "beam", "score"):
            if getattr(request, name) is not None:
                raise InvalidRequest(
                    f"{name} does not apply to a pmoe store (patch-level routing)", field=name
                )
        if request.mode is not None and self.spec.routing == "expert_choice":
            raise InvalidRequest("mode applies to token-choice pmoe stores only", field="mode")
        options = PatchOptions()
        if self.spec.routing == "token_choice":
            mode = request.mode if request.mode is not None else self.default_mode
            if mode not in ("tree", "exact"):
                raise InvalidRequest(f"unknown mode {mode!r}", field="mode")
            options = PatchOptions(mode="exact" if mode == "exact" else "tree")
        self.check(options)
        return options

    def check(self, options: Hashable) -> None:
        if not isinstance(options, PatchOptions):
            raise InvalidRequest("options of the wrong type for a pmoe store", field="gate")
        if options.mode not in (None, "tree", "exact"):
            raise InvalidRequest(f"unknown mode {options.mode!r}", field="mode")

    def route(self, x: torch.Tensor, options: Hashable) -> PatchRouting:
        assert isinstance(options, PatchOptions)
        patches = x.reshape(x.shape[0], self.num_patches, self.patch_dim)
        if self.spec.routing == "token_choice":
            return self._token_choice(patches, options.mode or self.default_mode)
        return self._expert_choice(patches)

    def _expert_choice(self, patches: torch.Tensor) -> PatchRouting:
        assert self.router_weight is not None and self.spec.patches_per_expert is not None
        b, n, _ = patches.shape
        k, top = len(self.experts), self.spec.patches_per_expert
        scores = router_scores(patches, self.router_weight)  # [B, k, n]
        indices = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :top]
        if self.spec.gating == "softmax":
            gates = torch.softmax(torch.gather(scores, 2, indices), dim=-1)
        else:
            gates = torch.ones(indices.shape, dtype=torch.float32)
        slot_expert = torch.arange(k).repeat_interleave(top).expand(b, k * top).contiguous()
        slot_gate = gates.reshape(b, k * top).to(torch.float64)
        experts, weights = expert_summary(slot_expert, k)
        return PatchRouting(
            slot_expert,
            indices.reshape(b, k * top),
            slot_gate,
            experts,
            weights,
            torch.full((b,), k * n, dtype=torch.int64),
            n,
            k,
        )

    def _token_choice(self, patches: torch.Tensor, mode: Literal["tree", "exact"]) -> PatchRouting:
        assert self.tree is not None
        b, n, d = patches.shape
        k = len(self.experts)
        routed = self.tree.route(patches.reshape(b * n, d), mode=mode)
        slot_expert = routed.experts[:, 0].reshape(b, n).to(torch.int64)
        slot_gate = torch.ones(b, n, dtype=torch.float64)
        experts, weights = expert_summary(slot_expert, k)
        return PatchRouting(
            slot_expert,
            torch.arange(n).expand(b, n).contiguous(),
            slot_gate,
            experts,
            weights,
            routed.distance_evals.reshape(b, n).sum(dim=1).to(torch.int64),
            n,
            k,
        )

    def concat(self, parts: list[Any]) -> PatchRouting:
        return PatchRouting.concat(parts)

    def start(self, x: torch.Tensor, routing: Any) -> _PatchRun:
        return _PatchRun(
            x, routing, self.experts, self.num_patches, self.spec.layout.expert_input_dim
        )

    def prefetch_keys(self, routing: Any) -> list[ExpertRef]:
        ids = torch.unique(routing.slot_expert[routing.slot_expert >= 0]).tolist()
        return [self.experts[int(e)] for e in ids]


class _PatchRun(OneRoundRun):
    """One batch: one round (a group per expert some patch went to), then per-row sums."""

    def __init__(
        self,
        x: torch.Tensor,
        routing: PatchRouting,
        experts: list[ExpertRef],
        num_patches: int,
        expert_input_dim: int,
    ) -> None:
        super().__init__()
        patches = x.reshape(x.shape[0] * num_patches, -1)
        pad = expert_input_dim - patches.shape[1]
        # Experts take patches zero-padded to an aligned width (experts_store.PATCH_ALIGN).
        self._patches = torch.nn.functional.pad(patches, (0, pad)) if pad else patches
        self._routing = routing
        self._experts = experts
        self._num_patches = num_patches
        self._slots: list[torch.Tensor] = []  # per planned group: its flat (row, slot) index

    def _groups(self) -> list[PlannedGroup]:
        r = self._routing
        width = r.slot_expert.shape[1]
        groups: list[PlannedGroup] = []
        # Stable by expert: within a group, slots stay in (row, slot) order.
        for e, slots in group_positions(r.slot_expert.reshape(-1)):
            rows = torch.div(slots, width, rounding_mode="floor")
            patch = r.slot_patch.reshape(-1)[slots]
            groups.append(
                PlannedGroup(
                    key=self._experts[int(e)],
                    rows=rows,
                    weights=r.slot_gate.reshape(-1)[slots],
                    inputs=self._patches[rows * self._num_patches + patch],
                )
            )
            self._slots.append(slots)
        return groups

    def _combine(self, plan: Plan, results: Sequence[GroupResult]) -> torch.Tensor:
        r = self._routing
        b, width = r.slot_expert.shape
        good = [
            (g, res, slots)
            for g, res, slots in zip(plan.groups, results, self._slots, strict=True)
            if res.error is None
        ]
        out_dim = int(good[0][1].outputs.shape[1]) if good else 0
        per_slot = torch.zeros(b * width, out_dim, dtype=torch.float64)
        for group, result, slots in good:
            per_slot[slots] = result.outputs.to(torch.float64) * group.weights[:, None]
        # Summed slot by slot, elementwise: each row's additions are the same in any batch.
        per_slot = per_slot.reshape(b, width, out_dim)
        out = torch.zeros(b, out_dim, dtype=torch.float64)
        for t in range(width):
            out += per_slot[:, t]
        return out.to(torch.float32)
