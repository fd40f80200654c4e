"""The answer of a routing call, and the input checks every router shares."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ._exceptions import (
    BadMode,
    BadTopK,
    DimensionMismatch,
    EmptyBatch,
    InputOutOfRange,
    NonFiniteInput,
    RouterInputError,
)

__all__ = ["Mode", "Routing", "check_mode", "check_top_k", "gate_weights", "to_inputs"]

Mode = Literal["tree", "exact"]

# Squared distances of inputs this large would overflow float32 (the tree walk's precision);
# refusing them is better than answering with an arbitrary expert.
MAX_ABS_INPUT = 1.0e15


@dataclass(frozen=True)
class Routing:
    """Where each input goes.

    experts: LongTensor [B, k], nearest first (ties to the lowest index).
    weights: FloatTensor [B, k], the gate softmax(-d^2 / temperature); rows sum to 1.
    distances: FloatTensor [B, k], Euclidean distance to each chosen prototype.
    distance_evals: LongTensor [B], distance evaluations each input cost.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    distances: torch.Tensor
    distance_evals: torch.Tensor


def to_inputs(
    x: torch.Tensor | np.ndarray, dim: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Check a batch and return it as a contiguous CPU tensor [B, dim] of `dtype` (float64,
    or float32 for the tree walk, which computes in float32).

    float32 inputs are checked as they are (their float64 copy would hold the same values, so
    the checks see the same extremes); other dtypes are checked in float64, so a float64 value
    beyond float32's range is still refused as out of range, not as infinite.
    """
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "fiu":
            raise RouterInputError(f"inputs must be real numbers, got numpy dtype {x.dtype}")
        if x.dtype == np.float32 and dtype == torch.float32:
            # A copy: the caller's array may be read-only, which torch will not wrap.
            t = torch.from_numpy(np.array(x, dtype=np.float32, order="C"))
        else:
            # One conversion; float32 values are checked alike in float64.
            t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    elif isinstance(x, torch.Tensor):
        if x.is_complex() or x.dtype == torch.bool:
            raise RouterInputError(f"inputs must be real numbers, got torch dtype {x.dtype}")
        checked = torch.float32 if x.dtype == torch.float32 else torch.float64
        t = x.detach().to(device="cpu", dtype=checked)
    else:
        raise RouterInputError(
            f"inputs must be a torch tensor or numpy array, got {type(x).__name__}"
        )
    if t.dim() != 2 or t.shape[1] != dim:
        if t.dim() == 2 and t.shape[0] == 0:
            raise EmptyBatch()
        raise DimensionMismatch(expected=dim, got=tuple(t.shape))
    if t.shape[0] == 0:
        raise EmptyBatch()
    # One pass for both checks: NaN and ±inf propagate into the extremes.
    low, high = torch.aminmax(t)
    max_abs = max(-float(low), float(high))
    if not math.isfinite(max_abs):
        finite = torch.isfinite(t).all(dim=1)
        raise NonFiniteInput(rows=torch.nonzero(~finite).flatten().tolist())
    if max_abs > MAX_ABS_INPUT:
        raise InputOutOfRange(max_abs=max_abs, limit=MAX_ABS_INPUT)
    return t.to(dtype).contiguous()


def check_mode(mode: object) -> Mode:
    if mode == "tree":
        return "tree"
    if mode == "exact":
        return "exact"
    raise BadMode(mode=mode)


def check_top_k(top_k: object, num_prototypes: int) -> int:
    # bool is an int subclass; top_k=True is a caller bug, not a request for one expert.
    if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer):
        raise BadTopK(top_k=top_k, num_prototypes=num_prototypes)
    k = int(top_k)
    if k < 1 or k > num_prototypes:
        raise BadTopK(top_k=top_k, num_prototypes=num_prototypes)
    return k


def gate_weights(sq_dist: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(-d^2 / temperature) over each row, computed in float64, returned float32."""
    if sq_dist.shape[1] == 1:
        return torch.ones(sq_dist.shape, dtype=torch.float32)
    logits = -sq_dist.to(torch.float64) / temperature
    return torch.softmax(logits, dim=1).to(torch.float32)
