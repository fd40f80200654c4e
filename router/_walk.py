"""Greedy tree descent (`tree` mode), batched level by level over the whole batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["WalkIndex", "greedy_walk"]

# Queries per chunk so that a gathered [rows, branching, n] block stays near 16 MB.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class WalkIndex:
    """The tree laid out for descent: leaves renumbered in breadth-first order, so the
    children of a node are consecutive rows and each step's gather reads one block."""

    nodes: torch.Tensor  # [num_internal + K, n] float32, internal points then leaves
    children: torch.Tensor  # [num_internal, branching] int64, -1 padded
    leaf_proto: torch.Tensor  # [K] int64, prototype index of leaf row num_internal + i
    num_internal: int

    @classmethod
    def from_tree(
        cls, points: torch.Tensor, prototypes: torch.Tensor, children: torch.Tensor
    ) -> WalkIndex:
        m = children.shape[0]
        if m == 0:
            return cls(prototypes.contiguous(), children, torch.zeros(1, dtype=torch.long), 0)
        is_leaf = children >= m
        leaf_proto = children[is_leaf] - m
        remapped = children.clone()
        remapped[is_leaf] = m + torch.arange(leaf_proto.numel())
        nodes = torch.cat([points, prototypes[leaf_proto]]).contiguous()
        return cls(nodes, remapped, leaf_proto, m)


def greedy_walk(
    x: torch.Tensor, index: WalkIndex
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Descend from the root into the nearest child until a leaf.

    x: float32 [B, n]. Returns (prototype index [B], squared distance to it [B] float32,
    evaluations [B]). Distances are direct differences in float32 and ties go to the
    lowest child slot, so the walk is a deterministic function of float32(x): the trainer
    and the server agree.
    """
    b, n = x.shape
    m = index.num_internal
    leaf = torch.empty(b, dtype=torch.long)
    sq = torch.empty(b, dtype=torch.float32)
    evals = torch.zeros(b, dtype=torch.long)
    if m == 0:
        diff = x - index.nodes[0]
        leaf.zero_()
        sq.copy_((diff * diff).sum(dim=1))
        return leaf, sq, evals
    nu = index.children.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(1, nu * n))
    for lo in range(0, b, step):
        hi = min(b, lo + step)
        xs = x[lo:hi]
        cur = torch.zeros(hi - lo, dtype=torch.long)
        ev = torch.zeros(hi - lo, dtype=torch.long)
        best = torch.empty(hi - lo, dtype=torch.float32)
        active: torch.Tensor | None = None  # None: every query of the chunk is still walking
        while True:
            node = cur if active is None else cur.index_select(0, active)
            xa = xs if active is None else xs.index_select(0, active)
            a = node.numel()
            ch = index.children.index_select(0, node)
            valid = ch >= 0
            diff = index.nodes.index_select(0, ch.clamp(min=0).flatten()).view(a, nu, n)
            diff -= xa[:, None, :]
            diff.mul_(diff)
            d = diff.sum(dim=2)
            d.masked_fill_(~valid, float("inf"))
            # min returns the first minimum: ties go to the lowest child slot.
            val, j = d.min(dim=1)
            nxt = ch.gather(1, j[:, None]).squeeze(1)
            if active is None:
                ev += valid.sum(dim=1)
                cur, best = nxt, val
                walking = nxt < m
                if bool(walking.all()):
                    continue
                active = torch.nonzero(walking).flatten()
            else:
                ev.index_add_(0, active, valid.sum(dim=1))
                cur.index_copy_(0, active, nxt)
                best.index_copy_(0, active, val)
                active = active[nxt < m]
            if active.numel() == 0:
                break
        leaf[lo:hi] = index.leaf_proto[cur - m]
        sq[lo:hi] = best
        evals[lo:hi] = ev
    return leaf, sq, evals
