"""The pool's two translations: a group's rows out to an actor as numpy, and an actor's
`GroupOutcome` back as the layer above's `GroupResult` (torch)."""

from __future__ import annotations

import numpy as np
import torch

from server.pool._types import ActorReply, GroupOutcome, GroupResult

__all__ = ["failed_result", "group_result", "rows_array"]

_EMPTY = torch.empty(0, 0)


def rows_array(rows: torch.Tensor) -> np.ndarray:
    """A group's rows as a float32 C-contiguous array, sharing the tensor's memory.

    The kinds' groups are already that (views of one gathered batch); detach, to and
    contiguous are then no-ops that still cost a dispatch each, per group, on the event loop.
    """
    if rows.dtype is torch.float32 and not rows.requires_grad and rows.is_contiguous():
        return rows.numpy()
    return rows.detach().to(torch.float32).contiguous().numpy()


def _to_tensor(array: np.ndarray | None) -> torch.Tensor:
    if array is None:
        return _EMPTY
    # Arrays from Ray's object store are read-only; torch needs writable memory.
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def group_result(
    outcome: GroupOutcome, reply: ActorReply, retry_after_s: float | None
) -> GroupResult:
    """`outcome` (one group of `reply`) as the layer above sees it."""
    return GroupResult(
        expert_id=outcome.expert_id,
        outputs=_to_tensor(outcome.outputs),
        hit=outcome.hit,
        load_ms=outcome.load_ms,
        compute_ms=outcome.compute_ms,
        expert_bytes=outcome.expert_bytes,
        activation_bytes=outcome.activation_bytes,
        actor=reply.actor,
        device_bytes=reply.device_bytes,
        error=outcome.error,
        error_kind=outcome.error_kind,
        key=outcome.key,
        generator_bytes=outcome.generator_bytes,
        retry_after_s=retry_after_s,
    )


def failed_result(
    expert_id: int, reason: str, kind: str, *, actor: str, retry_after_s: float | None = None
) -> GroupResult:
    """A group answered with an error and no outputs (the expert was not run)."""
    return GroupResult(
        expert_id=expert_id,
        outputs=_EMPTY,
        hit=False,
        load_ms=0.0,
        compute_ms=0.0,
        expert_bytes=0,
        activation_bytes=0,
        actor=actor,
        error=reason,
        error_kind=kind,
        retry_after_s=retry_after_s,
    )
