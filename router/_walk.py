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
    children of a node are consecutive rows and each step's gather reads one block.

    The step tables let `greedy_walk` take the same number of steps for every row, with no
    per-step bookkeeping of which rows are still walking: an empty child slot points to a
    sentinel node at +inf (so its distance is +inf, as a masked slot's would be), a leaf's
    only child is itself, and each leaf's count of measured children is known in advance.
    """

    nodes: torch.Tensor  # [num_internal + K, n] float32, internal points then leaves
    children: torch.Tensor  # [num_internal, branching] int64, -1 padded
    leaf_proto: torch.Tensor  # [K] int64, prototype index of leaf row num_internal + i
    num_internal: int
    step_nodes: torch.Tensor  # [num_internal + K + 1, n] float32: nodes, then the sentinel
    step_children: torch.Tensor  # [num_internal + K + 1, branching] int64, no -1
    leaf_evals: torch.Tensor  # [K] int64, children measured on the way to leaf row m + i
    steps: int  # levels of internal nodes on the longest root-to-leaf path (0 for K = 1)

    @classmethod
    def from_tree(
        cls, points: torch.Tensor, prototypes: torch.Tensor, children: torch.Tensor
    ) -> WalkIndex:
        m = children.shape[0]
        if m == 0:
            nodes = prototypes.contiguous()
            return cls(
                nodes, children, torch.zeros(1, dtype=torch.long), 0,
                nodes, children, torch.zeros(1, dtype=torch.long), 0,
            )  # fmt: skip
        is_leaf = children >= m
        leaf_proto = children[is_leaf] - m
        remapped = children.clone()
        remapped[is_leaf] = m + torch.arange(leaf_proto.numel())
        nodes = torch.cat([points, prototypes[leaf_proto]]).contiguous()
        total = nodes.shape[0]
        sentinel = total
        step_nodes = torch.cat([nodes, torch.full((1, nodes.shape[1]), float("inf"))])
        step_children = torch.full((total + 1, children.shape[1]), sentinel, dtype=torch.long)
        step_children[:m] = remapped.masked_fill(remapped < 0, sentinel)
        step_children[m:total, 0] = torch.arange(m, total)
        evals, steps = _evals_to_each_node(remapped, total)
        return cls(
            nodes, remapped, leaf_proto, m,
            step_nodes.contiguous(), step_children, evals[m:].contiguous(), steps,
        )  # fmt: skip


def _evals_to_each_node(children: torch.Tensor, total: int) -> tuple[torch.Tensor, int]:
    """Children measured on the way from the root to each node, and the tree's depth."""
    m = children.shape[0]
    measured = (children >= 0).sum(dim=1)
    evals = torch.zeros(total, dtype=torch.long)
    level = torch.zeros(1, dtype=torch.long)
    depth = 0
    while level.numel():
        kids = children.index_select(0, level)
        counts = evals.index_select(0, level) + measured.index_select(0, level)
        valid = kids >= 0
        evals[kids[valid]] = counts[:, None].expand_as(kids)[valid]
        nxt = kids[valid]
        level = nxt[nxt < m]
        depth += 1
    return evals, depth


def greedy_walk(
    x: torch.Tensor, index: WalkIndex
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Descend from the root into the nearest child until a leaf.

    x: float32 [B, n]. Returns (prototype index [B], squared distance to it [B] float32,
    evaluations [B]). Distances are direct differences in float32 and ties go to the
    lowest child slot, so the walk is a deterministic function of float32(x): the trainer
    and the server agree.

    Every row takes `index.steps` steps: one that reached a leaf stays there (a leaf's only
    child is itself; its distance, computed again the same way, is the same float). A step
    is eleven tensor calls whatever the rows' depths, which matters more than the few rows'
    extra arithmetic: a batch of tens of rows is routed on the event loop, where each call
    costs microseconds.
    """
    b, n = x.shape
    m = index.num_internal
    if m == 0:
        diff = x - index.nodes[0]
        return (
            torch.zeros(b, dtype=torch.long),
            (diff * diff).sum(dim=1),
            torch.zeros(b, dtype=torch.long),
        )
    nu = index.step_children.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(1, nu * n))
    leaf = torch.empty(b, dtype=torch.long)
    sq = torch.empty(b, dtype=torch.float32)
    for lo in range(0, b, step):
        hi = min(b, lo + step)
        rows = hi - lo
        xs = x[lo:hi, None, :]
        cur = torch.zeros(rows, dtype=torch.long)
        best = torch.empty(rows, dtype=torch.float32)
        for _ in range(index.steps):
            ch = index.step_children.index_select(0, cur)
            diff = index.step_nodes.index_select(0, ch.view(-1)).view(rows, nu, n)
            diff -= xs
            diff.mul_(diff)
            # min returns the first minimum: ties go to the lowest child slot.
            best, j = diff.sum(dim=2).min(dim=1)
            cur = ch.gather(1, j[:, None]).view(-1)
        leaf[lo:hi] = cur
        sq[lo:hi] = best
    leaf -= m
    return index.leaf_proto[leaf], sq, index.leaf_evals[leaf]
