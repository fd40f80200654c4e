"""Load-test inputs for a hyper store: random rows, each with a condition drawn from a seeded
table of N conditions under a uniform or Zipf law (rank r drawn with P ∝ 1/r^S).

Every distinct condition costs the server one generation of θ and |θ| of cache, so the law
over conditions plays the part the law over experts plays for a mixture.
"""

from __future__ import annotations

import bisect
import random
from typing import TYPE_CHECKING, Any

from ._exceptions import MomlpError
from ._workload import Distribution, _accumulate, expert_law

if TYPE_CHECKING:
    from ._models import ModelInfo

__all__ = ["ConditionWorkload"]

MAX_CONDITIONS = 1_000_000


class ConditionWorkload:
    """Draws (rows, conditions) batches; deterministic for a seed."""

    def __init__(
        self, model: ModelInfo, *, conditions: int, distribution: Distribution, seed: int
    ) -> None:
        if model.hyper is None:
            raise MomlpError(f"--conditions needs a hyper store; this one is {model.kind!r}")
        if distribution.kind == "cluster":
            raise MomlpError("the condition law is uniform or zipf:S")
        if not 1 <= conditions <= MAX_CONDITIONS:
            raise MomlpError(f"conditions must be in [1, {MAX_CONDITIONS}]")
        self.distribution = distribution
        self.input_dim = model.input_dim
        self.condition_dim = int(model.hyper["condition_dim"])
        table_rng = random.Random(seed)
        self.table = [
            [table_rng.gauss(0.0, 1.0) for _ in range(self.condition_dim)]
            for _ in range(conditions)
        ]
        self._rng = random.Random(seed + 1)
        self._cumulative = list(_accumulate(expert_law(distribution, conditions)))
        self.distinct_per_request: list[int] = []
        self._drawn: set[int] = set()

    def next_request(self, batch: int) -> tuple[list[list[float]], dict[str, Any]]:
        """Rows [batch, input_dim] and the request's `conditions` field."""
        rows = [[self._rng.gauss(0.0, 1.0) for _ in range(self.input_dim)] for _ in range(batch)]
        ranks = [
            min(bisect.bisect_right(self._cumulative, self._rng.random() * self._cumulative[-1]),
                len(self.table) - 1)
            for _ in range(batch)
        ]
        self.distinct_per_request.append(len(set(ranks)))
        self._drawn.update(ranks)
        return rows, {"conditions": [self.table[r] for r in ranks]}

    def describe(self) -> dict[str, Any]:
        drawn = self.distinct_per_request
        return {
            "distribution": f"conditions {self.distribution}",
            "conditions": len(self.table),
            "condition_dim": self.condition_dim,
            "distinct_per_request_mean": sum(drawn) / len(drawn) if drawn else None,
            "distinct_per_request_max": max(drawn, default=None),
            "distinct_drawn": len(self._drawn),
        }
