"""What the batching floor hands up: each request's answer and its per-expert figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

__all__ = ["BatchAnswer", "ExpertStat", "RouterLike", "RoutingLike"]


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


@dataclass(frozen=True)
class BatchAnswer:
    """What `Batcher.submit` returns for one request, rows in the request's order."""

    outputs: torch.Tensor  # [B, out]
    experts: torch.Tensor  # [B, k] int64
    weights: torch.Tensor  # [B, k] float32
    stats: list[ExpertStat]
    device_bytes: dict[str, int]  # actor -> resident expert bytes after its call
    distance_evals: torch.Tensor  # [B] int64
    route_ms: float = 0.0
    queue_ms: float = 0.0
    total_ms: float = 0.0

    @property
    def vram_bytes(self) -> int:
        """Max over the request's experts: the actor runs one expert at a time."""
        return max((stat.vram_bytes for stat in self.stats), default=0)


class RoutingLike(Protocol):
    @property
    def experts(self) -> torch.Tensor: ...
    @property
    def weights(self) -> torch.Tensor: ...
    @property
    def distance_evals(self) -> torch.Tensor: ...


class RouterLike(Protocol):
    """What the batcher needs of `router.PrototypeTree`."""

    @property
    def dim(self) -> int: ...
    @property
    def num_prototypes(self) -> int: ...
    def route(self, x: torch.Tensor, mode: Literal["tree", "exact"] = ..., top_k: int = ...) -> (
        RoutingLike
    ): ...
