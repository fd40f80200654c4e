"""A batch's bookkeeping, apart from its scheduling: each request's share of the groups its
kind planned (stats, VRAM, failures) and its rows of the routing and outputs.

A row routed to two experts sits in two groups; a group's `rows` are batch row indices, so a
request (a contiguous range of batch rows) finds its groups by counting rows in its range.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from server._exceptions import ExpertUnavailable
from server.batching._types import BatchAnswer, ExpertStat
from server.kinds import Plan, RowRouting
from server.pool import GroupResult

__all__ = ["Round", "request_answers"]

Round = tuple[Plan, Sequence[GroupResult]]


def request_answers(
    requests: list[tuple[int, float]],
    routing: RowRouting,
    outputs: torch.Tensor,
    rounds: list[Round],
    route_ms: float,
    started: float,
    finished: float,
) -> list[BatchAnswer | BaseException]:
    """Each request's (rows, submitted time) share of the batch: its answer, or the error of
    the first group it needed that failed."""
    sizes = torch.tensor([rows for rows, _ in requests], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(requests)), sizes)
    # uses[r]: (group's result, this request's rows in it, the group's rows, its label and
    # round), in plan order.
    uses: list[list[tuple[GroupResult, int, int, str, int]]] = [[] for _ in requests]
    for wave, (plan, results) in enumerate(rounds):
        for group, result in zip(plan.groups, results, strict=True):
            counts = torch.bincount(owner[group.rows], minlength=len(requests)).tolist()
            total = int(group.rows.shape[0])
            for r, count in enumerate(counts):
                if count:
                    uses[r].append((result, int(count), total, group.label, wave))
    answers: list[BatchAnswer | BaseException] = []
    start = 0
    evals = routing.distance_evals.to(torch.int64).reshape(-1)
    for (rows, submitted), mine in zip(requests, uses, strict=True):
        stop = start + rows
        failed = next((use for use in mine if use[0].error is not None), None)
        if failed is not None:
            answers.append(ExpertUnavailable(
                expert_id=failed[0].expert_id, reason=str(failed[0].error), node=failed[3] or None
            ))
            start = stop
            continue
        stats = [_stat(*use) for use in mine]
        device_bytes = {use[0].actor: use[0].device_bytes for use in mine}
        part = routing.slice(start, stop)
        width = max(1, int((part.experts >= 0).sum(dim=1).max()))
        answers.append(
            BatchAnswer(
                outputs=outputs[start:stop].clone(),
                experts=part.experts[:, :width].clone(),
                weights=part.weights[:, :width].clone(),
                stats=stats,
                device_bytes=device_bytes,
                distance_evals=evals[start:stop].clone(),
                route_ms=route_ms,
                queue_ms=(started - submitted) * 1000.0,
                total_ms=(finished - submitted) * 1000.0,
                routing=part,
            )
        )
        start = stop
    return answers


def _stat(result: GroupResult, rows: int, group_rows: int, label: str, wave: int
          ) -> ExpertStat:
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
        # A generated θ needs its hypernetwork resident beside it (pinned on the actor).
        vram_bytes=result.expert_bytes + result.generator_bytes + share,
        key=result.key,
        generator_bytes=result.generator_bytes,
        node=label or None,
        wave=wave if label else None,
    )
