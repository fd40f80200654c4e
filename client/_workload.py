"""Load-test inputs whose expert law is controlled: route-verified pools of inputs per expert.

Candidates are drawn near the store's prototypes, sent to `POST /v1/route` in bulk, and kept in a
pool under the expert they actually route to (tree routing need not agree with the nearest
prototype). Each request row then draws an expert from the law (uniform or Zipf over experts
ranked by a seeded permutation) and an input from that expert's pool.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._encoding import numpy_or_none
from ._exceptions import MomlpError, PayloadTooLarge

if TYPE_CHECKING:
    from ._async_client import AsyncClient
    from ._models import ModelInfo

__all__ = ["Distribution", "Workload", "build_workload", "expert_law"]

logger = logging.getLogger(__name__)

Kind = Literal["uniform", "zipf", "cluster"]


@dataclass(frozen=True)
class Distribution:
    """`uniform`, `zipf:S` (P(rank r) ∝ 1/r^S, r = 1..K) or `cluster` (no law control)."""

    kind: Kind
    exponent: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Distribution:
        name, _, arg = text.strip().partition(":")
        if name == "uniform" and not arg:
            return cls("uniform")
        if name == "cluster" and not arg:
            return cls("cluster")
        if name == "zipf":
            try:
                exponent = float(arg)
            except ValueError:
                exponent = -1.0
            if exponent >= 0 and math.isfinite(exponent):
                return cls("zipf", exponent)
        raise ValueError(f"distribution must be uniform, zipf:S (S >= 0) or cluster, got {text!r}")

    def __str__(self) -> str:
        return f"zipf:{self.exponent:g}" if self.kind == "zipf" else self.kind


def expert_law(distribution: Distribution, num_experts: int) -> list[float]:
    """Probability of each rank 0..K-1 (rank 0 is the most frequent expert)."""
    if distribution.kind == "zipf":
        weights = [1.0 / (rank + 1) ** distribution.exponent for rank in range(num_experts)]
    else:
        weights = [1.0] * num_experts
    total = sum(weights)
    return [weight / total for weight in weights]


class Workload:
    """Draws request batches; deterministic for a seed, in the order requests are drawn."""

    def __init__(
        self,
        *,
        distribution: Distribution,
        num_experts: int,
        pools: dict[int, list[list[float]]],
        prototypes: list[list[float]] | None,
        noise_std: float,
        seed: int,
        spacing: float = 0.0,
    ) -> None:
        self.distribution = distribution
        self.num_experts = num_experts
        self.pools = {expert: pool for expert, pool in pools.items() if pool}
        self.prototypes = prototypes
        self.noise_std = noise_std
        self.spacing = spacing
        self._rng = random.Random(seed + 1)
        self.ranking = list(range(num_experts))
        random.Random(seed).shuffle(self.ranking)
        self._cumulative = list(_accumulate(expert_law(distribution, num_experts)))
        if distribution.kind == "cluster":
            if not prototypes:
                raise MomlpError("the cluster distribution needs the store's prototypes")
        elif not self.pools:
            raise MomlpError("no route-verified input for any expert; cannot build the workload")

    def next_request(self, batch: int) -> list[list[float]]:
        return [self.next_row() for _ in range(batch)]

    def next_row(self) -> list[float]:
        if self.distribution.kind == "cluster":
            assert self.prototypes is not None
            center = self.prototypes[self._rng.randrange(len(self.prototypes))]
            return [value + self._rng.gauss(0.0, self.noise_std) for value in center]
        # Experts whose pool is empty (no candidate routed there) are re-drawn: the law holds
        # renormalised over the experts that have inputs.
        while True:
            rank = bisect.bisect_right(self._cumulative, self._rng.random() * self._cumulative[-1])
            pool = self.pools.get(self.ranking[min(rank, self.num_experts - 1)])
            if pool:
                return list(pool[self._rng.randrange(len(pool))])

    def expected_frequencies(self) -> dict[int, float]:
        """The law each served expert should follow (over experts with inputs); {} for cluster."""
        if self.distribution.kind == "cluster":
            return {}
        law = expert_law(self.distribution, self.num_experts)
        weights = {
            expert: law[rank] for rank, expert in enumerate(self.ranking) if expert in self.pools
        }
        total = sum(weights.values())
        return {expert: weight / total for expert, weight in weights.items()}

    def describe(self) -> dict[str, Any]:
        return {
            "distribution": str(self.distribution),
            "experts_with_inputs": len(self.pools),
            "pool_inputs": sum(len(pool) for pool in self.pools.values()),
            "prototype_spacing": self.spacing,
            "noise_std": self.noise_std,
        }


async def build_workload(
    client: AsyncClient,
    model: ModelInfo,
    *,
    distribution: Distribution,
    seed: int,
    mode: Literal["tree", "exact"] | None = None,
    candidates_per_expert: int = 8,
    max_candidates: int = 100_000,
    route_chunk_rows: int = 1024,
    noise_scale: float = 0.25,
) -> Workload:
    """Learn, through `/v1/route`, which expert each candidate input reaches."""
    rng = random.Random(seed)
    prototypes = model.prototypes
    dim, num_experts = model.input_dim, model.num_experts
    if prototypes:
        spacing = nearest_prototype_spacing(prototypes, rng)
    else:
        logger.warning("the server sent no prototypes; candidates are standard normal draws")
        spacing = 2.0 * math.sqrt(dim)
    # Noise of norm ~ noise_scale x spacing keeps most candidates inside their prototype's cell.
    noise_std = noise_scale * spacing / math.sqrt(dim)
    pools: dict[int, list[list[float]]] = {}
    if distribution.kind != "cluster":
        per_center = max(1, min(candidates_per_expert, max_candidates // max(num_experts, 1)))
        candidates = _candidates(prototypes, dim, num_experts, per_center, noise_std, rng)
        await _route_into_pools(client, candidates, pools, mode=mode, chunk=route_chunk_rows)
    logger.info(
        "workload %s: %d of %d experts have route-verified inputs (spacing %.4g, noise %.4g)",
        distribution,
        len(pools),
        num_experts,
        spacing,
        noise_std,
    )
    return Workload(
        distribution=distribution,
        num_experts=num_experts,
        pools=pools,
        prototypes=prototypes,
        noise_std=noise_std,
        seed=seed,
        spacing=spacing,
    )


def nearest_prototype_spacing(
    prototypes: list[list[float]], rng: random.Random, *, sample: int = 256
) -> float:
    """Median distance from a sample of prototypes to their nearest other prototype."""
    count = len(prototypes)
    if count < 2:
        return 1.0
    chosen = rng.sample(range(count), min(sample, count))
    np = numpy_or_none()
    if np is not None:
        points = np.asarray(prototypes, dtype=np.float64)
        # |a|^2 + |b|^2 - 2ab keeps memory at sample x K (a broadcast difference would be
        # sample x K x n); its rounding is irrelevant for a noise scale.
        norms = (points**2).sum(axis=1)
        squared = norms[chosen][:, None] + norms[None, :] - 2.0 * points[chosen] @ points.T
        squared[np.arange(len(chosen)), chosen] = np.inf
        nearest = [float(value) for value in np.sqrt(np.maximum(squared.min(axis=1), 0.0))]
    else:
        # Pure Python is O(sample x K x n): compare against a bounded random subset instead.
        others = rng.sample(range(count), min(count, 2048))
        nearest = [
            min(math.dist(prototypes[i], prototypes[j]) for j in others if j != i)
            for i in chosen[:64]
        ]
    positive = [value for value in nearest if value > 0 and math.isfinite(value)]
    return statistics.median(positive) if positive else 1.0


def _candidates(
    prototypes: list[list[float]] | None,
    dim: int,
    num_experts: int,
    per_center: int,
    noise_std: float,
    rng: random.Random,
) -> list[list[float]]:
    np = numpy_or_none()
    if np is not None:
        # Vectorised draws: a store with K x n in the millions stays a seconds-long set-up.
        generator = np.random.default_rng(rng.getrandbits(64))
        if not prototypes:
            return list(generator.normal(size=(num_experts * per_center, dim)).tolist())
        centers = np.repeat(np.asarray(prototypes, dtype=np.float64), per_center, axis=0)
        return list((centers + generator.normal(0.0, noise_std, size=centers.shape)).tolist())
    if not prototypes:
        return [[rng.gauss(0.0, 1.0) for _ in range(dim)] for _ in range(num_experts * per_center)]
    return [
        [value + rng.gauss(0.0, noise_std) for value in center]
        for center in prototypes
        for _ in range(per_center)
    ]


async def _route_into_pools(
    client: AsyncClient,
    candidates: list[list[float]],
    pools: dict[int, list[list[float]]],
    *,
    mode: Literal["tree", "exact"] | None,
    chunk: int,
) -> None:
    start = 0
    while start < len(candidates):
        rows = candidates[start : start + chunk]
        try:
            routing = await client.route(rows, top_k=1, mode=mode)
        except PayloadTooLarge:
            if chunk == 1:
                raise
            chunk = max(1, chunk // 2)
            continue
        for row, experts in zip(rows, routing.experts, strict=True):
            pools.setdefault(experts[0], []).append(row)
        start += len(rows)


def _accumulate(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out
