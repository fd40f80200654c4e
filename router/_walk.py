"""Greedy tree descent (`tree` mode), batched level by level over the whole batch."""

from __future__ import annotations

import torch

__all__ = ["greedy_walk"]

# Queries per chunk so that a gathered [rows, branching, n] block stays near 16 MB.
_CHUNK_ELEMENTS = 1 << 22


def greedy_walk(
    x: torch.Tensor, nodes: torch.Tensor, children: torch.Tensor, num_internal: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Descend from the root into the nearest child until a leaf.

    x: float32 [B, n]; nodes: float32 [num_internal + K, n] (internal points, then the
    prototypes); children: int64 [num_internal, branching], -1 padded.
    Returns (prototype index [B], squared distance to it [B] float32, evaluations [B]).
    Distances are direct differences in float32 and ties go to the lowest child slot, so
    the walk is a deterministic function of float32(x): the trainer and the server agree.
    """
    b, n = x.shape
    nu = children.shape[1] if children.dim() == 2 else 1
    leaf = torch.empty(b, dtype=torch.long)
    sq = torch.empty(b, dtype=torch.float32)
    evals = torch.zeros(b, dtype=torch.long)
    if num_internal == 0:
        diff = x - nodes[0]
        leaf.zero_()
        sq.copy_((diff * diff).sum(dim=1))
        return leaf, sq, evals
    step = max(1, _CHUNK_ELEMENTS // max(1, nu * n))
    for lo in range(0, b, step):
        hi = min(b, lo + step)
        xs = x[lo:hi]
        cur = torch.zeros(hi - lo, dtype=torch.long)
        ev = torch.zeros(hi - lo, dtype=torch.long)
        best = torch.empty(hi - lo, dtype=torch.float32)
        active = torch.arange(hi - lo)
        while active.numel() > 0:
            ch = children[cur[active]]
            valid = ch >= 0
            diff = xs[active, None, :] - nodes[ch.clamp(min=0)]
            d = (diff * diff).sum(dim=2)
            d.masked_fill_(~valid, float("inf"))
            # argmin returns the first minimum: ties go to the lowest child slot.
            val, j = d.min(dim=1)
            ev[active] += valid.sum(dim=1)
            nxt = ch.gather(1, j[:, None]).squeeze(1)
            cur[active] = nxt
            best[active] = val
            active = active[nxt < num_internal]
        leaf[lo:hi] = cur - num_internal
        sq[lo:hi] = best
        evals[lo:hi] = ev
    return leaf, sq, evals
