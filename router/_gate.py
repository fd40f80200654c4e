"""Gates: which experts a row uses and with which weights, as one request-time setting.

A `Gate` is the whole dial: the flat top-k softmax over the k nearest prototypes, or the
hierarchical beam walk (`beam`), either over squared distances or distances (`score`) at a
temperature, then dense-to-sparse pruning (`min_weight`, `top_p`) and renormalisation, so
rows may keep different numbers of experts. Every step is row by row, so a row's answer
never depends on the other rows of its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ._exceptions import BadGate
from ._routing import Mode, check_mode

__all__ = ["Gate", "GateRouting", "Score", "check_gate", "sparsify"]

Score = Literal["sqdist", "dist"]


@dataclass(frozen=True)
class Gate:
    """How to weight a row's experts.

    top_k: the k nearest prototypes (exact) with softmax(-score / temperature); 1 is the
    store's routing mode (`mode`) with weight 1. With tree_top_k="beam", top_k > 1 in tree
    mode is instead the k best leaves of the beam walk of width k (the soft form of the
    tree walk the experts were trained on: τ → 0 gives mode="tree"'s expert).
    beam: widths per tree level of the hierarchical gate (exclusive with top_k > 1); a
    shorter list reuses its last width.
    min_weight / top_p: drop experts below the weight / beyond the smallest prefix whose
    weights reach p, then renormalise (the heaviest expert is always kept).
    """

    top_k: int = 1
    mode: Mode = "tree"
    temperature: float = 1.0
    score: Score = "sqdist"
    min_weight: float = 0.0
    top_p: float = 1.0
    beam: tuple[int, ...] | None = None
    tree_top_k: Literal["nearest", "beam"] = "nearest"

    @property
    def max_experts(self) -> int:
        """The most experts a row can keep under this gate."""
        return self.beam[-1] if self.beam is not None else self.top_k


def check_gate(gate: Gate, num_prototypes: int) -> Gate:
    """`gate` if every field is usable with `num_prototypes` prototypes, else BadGate."""
    check_mode(gate.mode)
    if isinstance(gate.top_k, bool) or not isinstance(gate.top_k, int):
        raise BadGate(field="top_k", message=f"top_k must be an integer, got {gate.top_k!r}")
    if not 1 <= gate.top_k <= num_prototypes:
        raise BadGate(field="top_k", message=f"top_k must be in 1..{num_prototypes}")
    t = gate.temperature
    if not (isinstance(t, int | float) and math.isfinite(t) and t > 0):
        raise BadGate(field="temperature", message=f"temperature must be > 0, got {t!r}")
    if gate.score not in ("sqdist", "dist"):
        raise BadGate(field="score", message=f"score must be sqdist or dist, got {gate.score!r}")
    if not 0.0 <= gate.min_weight < 1.0:
        raise BadGate(field="min_weight", message="min_weight must be in [0, 1)")
    if not 0.0 < gate.top_p <= 1.0:
        raise BadGate(field="top_p", message="top_p must be in (0, 1]")
    if gate.beam is not None:
        if gate.top_k != 1:
            raise BadGate(field="beam", message="beam and top_k > 1 are exclusive")
        if not gate.beam or any(isinstance(w, bool) or w < 1 for w in gate.beam):
            raise BadGate(field="beam", message="beam must be a non-empty list of widths >= 1")
    return gate


@dataclass(frozen=True)
class GateRouting:
    """Each row's kept experts, heaviest first.

    experts: [B, L] int64, -1 after a row's last kept expert; weights: [B, L] float64, each
    row summing to 1 (0 where padded); distances: [B, L] float32 Euclidean (nan where
    padded); distance_evals: [B] int64.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    distances: torch.Tensor
    distance_evals: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.experts.shape[0])

    @property
    def kept(self) -> torch.Tensor:
        """Experts kept per row [B] int64."""
        return (self.experts >= 0).sum(dim=1)

    def slice(self, start: int, stop: int) -> GateRouting:
        return GateRouting(
            self.experts[start:stop], self.weights[start:stop],
            self.distances[start:stop], self.distance_evals[start:stop],
        )

    @staticmethod
    def concat(parts: list[GateRouting]) -> GateRouting:
        """Rows of `parts` in order; narrower parts are padded to the widest."""
        if len(parts) == 1:
            return parts[0]
        width = max(int(p.experts.shape[1]) for p in parts)

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            extra = width - int(t.shape[1])
            return t if extra == 0 else torch.nn.functional.pad(t, (0, extra), value=value)

        return GateRouting(
            torch.cat([pad(p.experts, -1) for p in parts]),
            torch.cat([pad(p.weights, 0.0) for p in parts]),
            torch.cat([pad(p.distances, float("nan")) for p in parts]),
            torch.cat([p.distance_evals for p in parts]),
        )


def sparsify(
    experts: torch.Tensor, weights: torch.Tensor, distances: torch.Tensor, gate: Gate
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort each row heaviest first, drop what `min_weight` / `top_p` drop, renormalise.

    experts [B, L] (-1 = none), weights [B, L] float64 summing to 1 over the real experts.
    Returns the same shapes, trimmed to the widest row kept.
    """
    weights = weights.masked_fill(experts < 0, -1.0)
    order = torch.argsort(-weights, dim=1, stable=True)
    experts, weights, distances = (t.gather(1, order) for t in (experts, weights, distances))
    keep = experts >= 0
    if gate.min_weight > 0.0:
        keep &= weights >= gate.min_weight
    if gate.top_p < 1.0:
        before = torch.cumsum(weights.clamp(min=0.0), dim=1) - weights.clamp(min=0.0)
        keep &= before < gate.top_p
    keep[:, 0] = experts[:, 0] >= 0
    weights = weights.masked_fill(~keep, 0.0)
    weights = weights / weights.sum(dim=1, keepdim=True)
    width = int(keep.sum(dim=1).max())
    experts = experts.masked_fill(~keep, -1)[:, :width]
    distances = distances.masked_fill(~keep, float("nan"))[:, :width]
    return experts, weights[:, :width], distances
