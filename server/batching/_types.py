"""What the batching floor hands up: each request's answer and its per-expert figures.

Records built per group or per request (`ExpertStat` and `BatchAnswer`) are plain dataclasses,
not frozen: a frozen dataclass sets each field through `object.__setattr__`, about a
microsecond more per record, and a 16-request batch builds ~200 of them (6 % of the server's
own path, measured by `benchmarks/server_path.py`). Nothing changes one after it is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["BatchAnswer", "ExpertStat"]


@dataclass  # not frozen: built per group or per request (module docstring)
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
    node: str | None = None  # graph stores: the node this expert served, and its wave
    wave: int | None = None


@dataclass  # not frozen: built per group or per request (module docstring)
class BatchAnswer:
    """What `Batcher.submit` returns for one request, rows in the request's order.

    The arrays are numpy views of the batch's (nothing writes to them): what an answer is
    made of is sliced and listed per request on the event loop, where a numpy call costs a
    fraction of a torch one.
    """

    outputs: np.ndarray  # [B, out] float32
    experts: np.ndarray  # [B, L] int64, heaviest first; -1 after a row's last kept expert
    weights: np.ndarray  # [B, L] float64, 0 where padded; each row sums to 1
    stats: list[ExpertStat]
    device_bytes: dict[str, int]  # actor -> resident expert bytes after its call
    distance_evals: np.ndarray  # [B] int64
    route_ms: float = 0.0
    queue_ms: float = 0.0
    total_ms: float = 0.0
    # The batch's routing and this request's rows of it; `routing` slices it when asked.
    batch_routing: Any = None
    rows: tuple[int, int] = (0, 0)

    @property
    def routing(self) -> Any:
        """This request's rows of its kind's routing (pmoe: patch choices; graph: per node);
        sliced on demand, since most answers never look."""
        if self.batch_routing is None:
            return None
        return self.batch_routing.slice(*self.rows)

    @property
    def vram_bytes(self) -> int:
        """Max over the request's experts: the actor runs one expert at a time. A graph's
        (stats carry nodes): the sum over nodes of each node's largest, since a row holds
        one value per node on its way through the waves."""
        if any(stat.node is not None for stat in self.stats):
            return sum(self.wave_vram_bytes)
        return max((stat.vram_bytes for stat in self.stats), default=0)

    @property
    def wave_vram_bytes(self) -> list[int]:
        """Graph stores: per wave, the sum over its nodes of each node's largest expert
        (parameters + this request's activation share); empty for other kinds."""
        per_node: dict[tuple[int, str], int] = {}
        for stat in self.stats:
            if stat.node is not None and stat.wave is not None:
                key = (stat.wave, stat.node)
                per_node[key] = max(per_node.get(key, 0), stat.vram_bytes)
        waves = 1 + max((wave for wave, _ in per_node), default=-1)
        totals = [0] * waves
        for (wave, _), value in per_node.items():
            totals[wave] += value
        return totals

    def kept(self) -> list[tuple[list[int], list[float]]]:
        """Each row's kept experts and their weights, without the padding."""
        rows: list[tuple[list[int], list[float]]] = []
        for experts, weights in zip(self.experts.tolist(), self.weights.tolist(), strict=True):
            n = sum(1 for e in experts if e >= 0)
            rows.append((experts[:n], weights[:n]))
        return rows
