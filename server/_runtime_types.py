"""Plain data passed between the batcher, the dispatcher, the pools and the actors.

Two layers: what crosses the Ray boundary (`GroupOutcome`, `ActorReply`: numpy arrays only, so Ray
moves rows as out-of-band buffers and never pickles a tensor) and what the batcher sees
(`Group`, `GroupResult`: torch tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch

__all__ = [
    "ActorInfo",
    "ActorReply",
    "BatchAnswer",
    "ExpertPool",
    "ExpertStat",
    "Group",
    "GroupOutcome",
    "GroupResult",
    "RouterLike",
    "RoutingLike",
]


@dataclass(frozen=True)
class Group:
    """All rows of one batch that go to one expert."""

    expert_id: int
    rows: torch.Tensor  # [m, n] float32


@dataclass(frozen=True)
class GroupResult:
    """The answer for one `Group`, in the order the groups were given.

    `error` is set (and `outputs` empty) when the expert could not be served, e.g. a bad
    checksum or a missing file: only the requests that need that expert fail.
    """

    expert_id: int
    outputs: torch.Tensor  # [m, out]
    hit: bool
    load_ms: float
    compute_ms: float
    expert_bytes: int
    activation_bytes: int
    actor: str
    device_bytes: int = 0  # resident expert bytes of the actor after the call
    error: str | None = None
    error_kind: str | None = None


@dataclass(frozen=True)
class GroupOutcome:
    """An actor's answer for one group, as it crosses the Ray boundary (numpy only)."""

    expert_id: int
    outputs: np.ndarray | None
    hit: bool = False
    load_ms: float = 0.0
    compute_ms: float = 0.0
    expert_bytes: int = 0
    activation_bytes: int = 0
    error: str | None = None
    error_kind: str | None = None  # "load" (bad file: remembered), "busy", "internal"


@dataclass(frozen=True)
class ActorReply:
    """One actor call's answer: per-group outcomes plus the actor's cache after the call."""

    actor: str
    results: list[GroupOutcome]
    device_bytes: int
    resident: dict[int, int]
    evictions: int = 0  # experts this actor's cache evicted since it (re)started


@dataclass(frozen=True)
class ActorInfo:
    """What GET /v1/experts shows about one actor."""

    name: str
    device: str
    resident_bytes: int
    budget_bytes: int
    resident: list[int] = field(default_factory=list)
    alive: bool = True
    evictions: int = 0  # since the actor (re)started, as of its latest reply


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


class ExpertPool(Protocol):
    """The seam between the batcher and whatever runs experts (Ray actors or in-process)."""

    async def run(self, groups: list[Group]) -> list[GroupResult]: ...
    async def prefetch(self, expert_ids: list[int]) -> None: ...
    def residency(self) -> dict[int, list[str]]: ...
    def actors(self) -> list[ActorInfo]: ...
    async def close(self) -> None: ...
