"""How a pmoe store routes patches: `PatchRouting`, the routing of some rows (per row and
slot: the expert, its patch and the gate), and expert choice's learned router, read from its
file (`read_router_weight`) and applied (`router_scores`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from experts_store import PMOE_ROUTER_TENSOR, file_problem
from router import RouterFileError
from server.kinds._views import PatchChoice

__all__ = ["PatchRouting", "expert_summary", "read_router_weight", "router_scores"]

# Rows scored at once: bounds the [rows, k, n, d] product tensor of the scores.
_SCORE_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class PatchRouting:
    """Routing of some rows: per (row, slot), the expert, its patch and the gate."""

    slot_expert: torch.Tensor  # [B, T] int64
    slot_patch: torch.Tensor  # [B, T] int64
    slot_gate: torch.Tensor  # [B, T] float64
    experts: torch.Tensor  # [B, L] int64: the experts used, most patches first, -1 padded
    weights: torch.Tensor  # [B, L] float64: each expert's share of the row's patches
    distance_evals: torch.Tensor  # [B] int64: router evaluations per row
    num_patches: int
    num_experts: int

    @property
    def rows(self) -> int:
        return int(self.slot_expert.shape[0])

    @property
    def distances(self) -> torch.Tensor:
        # No distances in patch routing; the shape keeps RowRouting's contract.
        return torch.zeros(self.experts.shape, dtype=torch.float32)

    @property
    def dense_patches(self) -> int:
        return self.rows * self.num_patches * self.num_experts

    def slice(self, start: int, stop: int) -> PatchRouting:
        return PatchRouting(
            self.slot_expert[start:stop],
            self.slot_patch[start:stop],
            self.slot_gate[start:stop],
            self.experts[start:stop],
            self.weights[start:stop],
            self.distance_evals[start:stop],
            self.num_patches,
            self.num_experts,
        )

    @classmethod
    def concat(cls, parts: Sequence[PatchRouting]) -> PatchRouting:
        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(p, name) for p in parts])

        return cls(
            cat("slot_expert"),
            cat("slot_patch"),
            cat("slot_gate"),
            cat("experts"),
            cat("weights"),
            cat("distance_evals"),
            parts[0].num_patches,
            parts[0].num_experts,
        )

    def patch_choices(self) -> list[list[PatchChoice]]:
        choices: list[list[PatchChoice]] = []
        for experts, patches, gates in zip(
            self.slot_expert.tolist(), self.slot_patch.tolist(), self.slot_gate.tolist(),
            strict=True,
        ):
            by_expert: dict[int, tuple[list[int], list[float]]] = {}
            for e, j, g in zip(experts, patches, gates, strict=True):
                if e >= 0:
                    taken = by_expert.setdefault(e, ([], []))
                    taken[0].append(j)
                    taken[1].append(g)
            choices.append([PatchChoice(e, *by_expert[e]) for e in sorted(by_expert)])
        return choices


def expert_summary(
    slot_expert: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the experts used and each one's share of the row's patch computations,
    largest first (ties to the lower id): 1/k each under expert choice."""
    used = slot_expert >= 0
    count = torch.zeros(slot_expert.shape[0], num_experts, dtype=torch.float64)
    count.scatter_add_(1, slot_expert.clamp(min=0), used.double())
    share = count / count.sum(dim=1, keepdim=True).clamp(min=1.0)
    order = torch.sort(-share, dim=1, stable=True).indices
    experts = torch.where(torch.gather(count, 1, order) > 0, order, -1)
    weights = torch.where(experts >= 0, torch.gather(share, 1, order), 0.0)
    return experts, weights


def router_scores(patches: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """<w_s, x^(j)> for every row, expert s and patch j: [B, k, n] float32.

    The same elementwise product summed over its last axis as `trainer.pmoe` (so the top-l
    agrees with the offline model bit for bit), in row chunks: a row's sum is the same in any
    chunk, where a BLAS matmul may pick another kernel, and summation order, per batch size.
    """
    b, n, d = patches.shape
    k = weight.shape[0]
    chunk = max(1, _SCORE_CHUNK_ELEMENTS // max(1, k * n * d))
    parts = [
        (rows[:, None, :, :] * weight[None, :, None, :]).sum(dim=-1)
        for rows in torch.split(patches, chunk)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, k, n)


def read_router_weight(path: Path) -> torch.Tensor:
    """An expert-choice store's learned router [k, d]: float32 and finite (a NaN weight
    would score every patch NaN, and the top-l of NaN scores is an arbitrary choice)."""
    problem = file_problem(path)  # a FIFO, not only a missing file: it would block the read
    if problem is not None:
        raise RouterFileError(path=path, message=problem)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise RouterFileError(
            path=path, message=f"not a readable safetensors file ({exc})"
        ) from exc
    weight = tensors.get(PMOE_ROUTER_TENSOR)
    if weight is None or weight.dtype != torch.float32 or weight.dim() != 2:
        got = "none" if weight is None else f"{weight.dtype} {list(weight.shape)}"
        raise RouterFileError(
            path=path, message=f"no float32 [k, d] {PMOE_ROUTER_TENSOR!r} (got {got})"
        )
    if not bool(torch.isfinite(weight).all()):
        raise RouterFileError(path=path, message=f"{PMOE_ROUTER_TENSOR!r} is not finite")
    return weight.contiguous()
