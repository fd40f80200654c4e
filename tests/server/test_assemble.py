"""Each request's share of a batch's groups: the one-bincount count equals a count by hand."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch

from server.batching._assemble import Round, _uses

pytestmark = pytest.mark.unit


def _by_hand(requests: list[tuple[int, float]], rounds: list[Any]) -> list[list[Any]]:
    owner = [r for r, (rows, _) in enumerate(requests) for _ in range(rows)]
    uses: list[list[Any]] = [[] for _ in requests]
    for wave, (plan, results) in enumerate(rounds):
        for group, result in zip(plan.groups, results, strict=True):
            rows = group.rows.tolist()
            for r in range(len(requests)):
                count = sum(1 for row in rows if owner[row] == r)
                if count:
                    uses[r].append((result, count, len(rows), group.label, wave))
    return uses


@pytest.mark.parametrize("seed", range(20))
def test_each_request_gets_its_rows_of_every_group_in_plan_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    requests = [(int(rows), 0.0) for rows in rng.integers(1, 6, size=rng.integers(1, 9))]
    total = sum(rows for rows, _ in requests)
    rounds = []
    for wave in range(int(rng.integers(1, 4))):
        groups = [
            SimpleNamespace(
                rows=torch.from_numpy(np.sort(rng.choice(total, size=int(size), replace=False))),
                label=f"node{wave}" if wave else "",
            )
            for size in rng.integers(1, total + 1, size=rng.integers(0, 7))
        ]
        results = [object() for _ in groups]
        rounds.append((SimpleNamespace(groups=groups), results))
    assert _uses(requests, cast(list[Round], rounds)) == _by_hand(requests, rounds)
