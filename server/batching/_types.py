"""What the batching floor hands up: each request's answer and its per-expert figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["BatchAnswer", "ExpertStat"]


@dataclass(frozen=True)
class ExpertStat:
    """Per-request, per-expert figures (the HTTP `ExpertStat`)."""

    expert_id: int
    rows: int
    cache: Literal["hit", "miss"]
    load_ms: float
    compute_ms: float
    actor: str
    expert_bytes: int
    activation_bytes: int
    vram_bytes: int
    key: str | None = None  # kind hyper: the generated θ's cache key
    generator_bytes: int = 0  # kind hyper: the pinned hypernetwork's bytes


@dataclass(frozen=True)
class BatchAnswer:
    """What `Batcher.submit` returns for one request, rows in the request's order."""

    outputs: torch.Tensor  # [B, out]
    experts: torch.Tensor  # [B, L] int64, heaviest first; -1 after a row's last kept expert
    weights: torch.Tensor  # [B, L] float64, 0 where padded; each row sums to 1
    stats: list[ExpertStat]
    device_bytes: dict[str, int]  # actor -> resident expert bytes after its call
    distance_evals: torch.Tensor  # [B] int64
    route_ms: float = 0.0
    queue_ms: float = 0.0
    total_ms: float = 0.0
    routing: Any = None  # this request's rows of the kind's RowRouting (e.g. patch choices)

    @property
    def vram_bytes(self) -> int:
        """Max over the request's experts: the actor runs one expert at a time."""
        return max((stat.vram_bytes for stat in self.stats), default=0)

    def kept(self) -> list[tuple[list[int], list[float]]]:
        """Each row's kept experts and their weights, without the padding."""
        rows: list[tuple[list[int], list[float]]] = []
        for experts, weights in zip(self.experts.tolist(), self.weights.tolist(), strict=True):
            n = sum(1 for e in experts if e >= 0)
            rows.append((experts[:n], weights[:n]))
        return rows
