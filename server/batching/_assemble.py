"""A batch's bookkeeping, apart from its scheduling: each request's share of the groups its
kind planned (stats, VRAM, failures) and its rows of the routing and outputs.

A row routed to two experts sits in two groups; a group's `rows` are batch row indices, so a
request (a contiguous range of batch rows) finds its groups by counting rows in its range.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from server._exceptions import ExpertUnavailable, InvalidRequest, ServerError
from server.batching._types import BatchAnswer, ExpertStat
from server.kinds import Plan, RowRouting
from server.pool import GroupResult

__all__ = ["BatchAnswers", "Round"]

Round = tuple[Plan, Sequence[GroupResult]]


class BatchAnswers:
    """A finished batch's answers, each built when its request asks for it.

    The batch's shared work (which request used which group, the rows' widths) is done here,
    once; a request's own answer (its stats, its slices) is built by `answer(r)` in that
    request's coroutine. So the first response leaves as soon as the batch is done instead of
    after every answer of the batch was built (~25 µs each on the 2-core VM), and the rest
    are built while the first clients already read theirs.
    """

    def __init__(
        self,
        requests: list[tuple[int, float]],
        routing: RowRouting,
        outputs: torch.Tensor,
        rounds: list[Round],
        route_ms: float,
        started: float,
        finished: float,
    ) -> None:
        self._requests = requests
        self._routing = routing
        # numpy views, sliced per request (see BatchAnswer).
        self._outputs = outputs.numpy(force=True)
        self._experts = routing.experts.numpy(force=True)
        self._weights = routing.weights.numpy(force=True)
        self._route_ms = route_ms
        self._started = started
        self._finished = finished
        self._uses = _uses(requests, rounds)
        self._evals = routing.distance_evals.to(torch.int64).reshape(-1).numpy(force=True)
        # Each row's count of chosen experts, once per batch (three tensor ops per request
        # added up to more than the rest of a request's share).
        self._chosen = (self._experts >= 0).sum(axis=1).tolist()
        self._starts = list(itertools.accumulate((rows for rows, _ in requests), initial=0))
        # Once per batch; a request's own rows are looked at only when this fails.
        self._finite = bool(np.isfinite(self._outputs).all())

    def failure(self, r: int) -> ServerError | None:
        """The error of the first group request `r` needed that failed, if one did; else a
        422 if one of its rows' outputs is not finite."""
        failed = next((use for use in self._uses[r] if use[0].error is not None), None)
        if failed is None:
            return None if self._finite else self._non_finite(r)
        return ExpertUnavailable(
            expert_id=failed[0].expert_id,
            reason=str(failed[0].error),
            node=failed[3] or None,
            retry_after_s=failed[0].retry_after_s,
        )

    def _non_finite(self, r: int) -> InvalidRequest | None:
        # Finite inputs far outside the store's range can overflow float32 in an expert (or
        # in a hyper store's θ): NaN would be `null` in a JSON answer, or not JSON at all.
        bad = np.argwhere(~np.isfinite(self._outputs[self._starts[r] : self._starts[r + 1]]))
        if len(bad) == 0:
            return None
        return InvalidRequest(
            f"the output of row {int(bad[0][0])} is not finite: its input, or on a hyper store"
            " its condition, overflows float32 in the model (is it far outside the range the"
            " model was trained on?)",
            field="inputs",
        )

    def answer(self, r: int) -> BatchAnswer:
        """Request `r`'s answer (one whose `failure(r)` is None)."""
        mine = self._uses[r]
        start, stop = self._starts[r], self._starts[r + 1]
        width = max(1, *self._chosen[start:stop])
        # Views into the batch's arrays, not copies: nothing writes to an answer, and it is
        # dropped once sent.
        return BatchAnswer(
            outputs=self._outputs[start:stop],
            experts=self._experts[start:stop, :width],
            weights=self._weights[start:stop, :width],
            stats=[_stat(*use) for use in mine],
            device_bytes={use[0].actor: use[0].device_bytes for use in mine},
            distance_evals=self._evals[start:stop],
            route_ms=self._route_ms,
            queue_ms=(self._started - self._requests[r][1]) * 1000.0,
            total_ms=(self._finished - self._requests[r][1]) * 1000.0,
            batch_routing=self._routing,
            rows=(start, stop),
        )


_Use = tuple[GroupResult, int, int, str, int]


def _uses(requests: list[tuple[int, float]], rounds: list[Round]) -> list[list[_Use]]:
    """uses[r]: (group's result, request r's rows in it, the group's rows, its label, its
    round) for each group request r has rows in, in plan order.

    One `bincount` over (group, request) pairs counts every group at once: a batch has tens of
    groups, and a count per group was a tenth of the event loop's time under load.
    """
    uses: list[list[_Use]] = [[] for _ in requests]
    groups = [
        (group, result, wave)
        for wave, (plan, results) in enumerate(rounds)
        for group, result in zip(plan.groups, results, strict=True)
    ]
    if not groups:
        return uses
    sizes = torch.tensor([rows for rows, _ in requests], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(requests)), sizes)
    group_rows = [group.rows for group, _, _ in groups]
    totals = torch.tensor([int(rows.shape[0]) for rows in group_rows], dtype=torch.long)
    which = torch.repeat_interleave(torch.arange(len(groups)), totals)
    pairs = which * len(requests) + owner[torch.cat(group_rows)]
    counts = torch.bincount(pairs, minlength=len(groups) * len(requests))
    found = counts.nonzero().flatten()  # ascending: by group (plan order), then request
    totals_list = totals.tolist()
    for pair, count in zip(found.tolist(), counts[found].tolist(), strict=True):
        g, r = divmod(pair, len(requests))
        group, result, wave = groups[g]
        uses[r].append((result, count, totals_list[g], group.label, wave))
    return uses


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
