"""A batch's arithmetic, apart from its scheduling: expert groups from a routing, the pool's
outputs back into row order (weighted for top_k > 1), and each request's answer and stats.

Each (row, k) pair of a routing is one row for expert k, so a row routed to two experts sits
in two groups; `group_pairs[i]` lists the pair indices of group i, in the order the group's
rows were sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from experts_store import ExpertRef
from server._exceptions import ExpertUnavailable
from server.batching._types import BatchAnswer, ExpertStat
from server.pool import Group, GroupResult

__all__ = [
    "RoutingSlice",
    "concat_routings",
    "expert_groups",
    "gather_outputs",
    "request_answers",
    "slice_routing",
]


@dataclass(frozen=True)
class RoutingSlice:
    """The parts of a routing a batch needs, for rows routed ahead of their batch."""

    experts: torch.Tensor
    weights: torch.Tensor
    distance_evals: torch.Tensor


def slice_routing(routing: Any, start: int, stop: int) -> RoutingSlice:
    return RoutingSlice(
        routing.experts[start:stop], routing.weights[start:stop],
        routing.distance_evals[start:stop],
    )


def concat_routings(parts: list[Any]) -> RoutingSlice:
    return RoutingSlice(
        torch.cat([p.experts for p in parts]), torch.cat([p.weights for p in parts]),
        torch.cat([p.distance_evals for p in parts]),
    )


def expert_groups(
    x: torch.Tensor, experts: torch.Tensor, refs: Sequence[ExpertRef]
) -> tuple[list[Group], list[torch.Tensor]]:
    """One group per distinct expert of experts [B, top_k], in expert order, and its pairs;
    `refs[e]` names expert e's file in the store version the batch entered."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    pair_rows = torch.arange(x.shape[0]).repeat_interleave(top_k)
    order = torch.argsort(flat, stable=True)
    unique, counts = torch.unique_consecutive(flat[order], return_counts=True)
    group_pairs = list(torch.split(order, counts.tolist()))
    groups = [
        Group(expert=refs[int(e)], rows=x[pair_rows[pairs]])
        for e, pairs in zip(unique.tolist(), group_pairs, strict=True)
    ]
    return groups, group_pairs


def gather_outputs(
    results: list[GroupResult], group_pairs: list[torch.Tensor], weights: torch.Tensor
) -> torch.Tensor:
    """Outputs [B, out]: each row's expert output, or the weighted sum over its top_k.

    Rows of a failed group stay zero; their requests are answered with the error instead.
    """
    rows, top_k = weights.shape
    good = [r for r in results if r.error is None]
    out_dim = int(good[0].outputs.shape[1]) if good else 0
    flat_out = torch.zeros(rows * top_k, out_dim)
    for pairs, result in zip(group_pairs, results, strict=True):
        if result.error is None:
            flat_out[pairs] = result.outputs.to(torch.float32)
    per_pair = flat_out.view(rows, top_k, out_dim)
    return per_pair[:, 0] if top_k == 1 else (per_pair * weights.unsqueeze(-1)).sum(1)


def request_answers(
    requests: list[tuple[int, float]],
    distance_evals: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    outputs: torch.Tensor,
    results: list[GroupResult],
    route_ms: float,
    started: float,
    finished: float,
) -> list[BatchAnswer | BaseException]:
    """Each request's (rows, submitted time) share of the batch: its answer, or the error of
    the first expert it needed that failed."""
    by_expert = {r.expert_id: r for r in results}
    group_rows = {e: int(r.outputs.shape[0]) for e, r in by_expert.items()}
    answers: list[BatchAnswer | BaseException] = []
    start = 0
    evals = distance_evals.to(torch.int64).reshape(-1)
    for rows, submitted in requests:
        stop = start + rows
        mine = experts[start:stop]
        ids, counts = np.unique(mine.reshape(-1).numpy(), return_counts=True)
        failed = [int(e) for e in ids if by_expert[int(e)].error is not None]
        if failed:
            first = by_expert[failed[0]]
            answers.append(ExpertUnavailable(expert_id=failed[0], reason=str(first.error)))
            start = stop
            continue
        stats = [
            _stat(by_expert[int(e)], int(count), group_rows[int(e)])
            for e, count in zip(ids.tolist(), counts.tolist(), strict=True)
        ]
        device_bytes: dict[str, int] = {}
        for stat in stats:
            device_bytes[stat.actor] = by_expert[stat.expert_id].device_bytes
        answers.append(
            BatchAnswer(
                outputs=outputs[start:stop].clone(),
                experts=mine.clone(),
                weights=weights[start:stop].clone(),
                stats=stats,
                device_bytes=device_bytes,
                distance_evals=evals[start:stop].clone(),
                route_ms=route_ms,
                queue_ms=(started - submitted) * 1000.0,
                total_ms=(finished - submitted) * 1000.0,
            )
        )
        start = stop
    return answers


def _stat(result: GroupResult, rows: int, group_rows: int) -> ExpertStat:
    share = result.activation_bytes * rows // max(group_rows, 1)
    return ExpertStat(
        expert_id=result.expert_id,
        rows=rows,
        cache="hit" if result.hit else "miss",
        load_ms=result.load_ms,
        compute_ms=result.compute_ms,
        actor=result.actor,
        expert_bytes=result.expert_bytes,
        activation_bytes=result.activation_bytes,
        vram_bytes=result.expert_bytes + share,
    )
