"""The hierarchical gate: a soft beam walk down the prototype tree (seed 002, eq. 20).

Every node in the beam scores its ν children with a softmax over siblings; a candidate's
log-weight is its parent's plus its own level's log-softmax, and the `width` best candidates
of each level survive (a leaf reached early competes as it is). A leaf's weight is the product
of its level weights, renormalised over the leaves that survived (with nothing pruned the
products already sum to 1: the dense hierarchical mixture).

Distances are float32 direct differences gathered exactly as the greedy walk gathers them and
ranked with the same tie rule (smaller distance, then the lower slot), so a beam of width 1
at every level reaches the greedy walk's leaf: `beam = [1, ...]` is `mode="tree"`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._walk import WalkIndex

__all__ = ["BeamResult", "beam_walk"]

# Rows per chunk so that a gathered [rows, width, branching, n] block stays near 16 MB.
_CHUNK_ELEMENTS = 1 << 22

BeamResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def beam_walk(
    x: torch.Tensor,
    index: WalkIndex,
    widths: Sequence[int],
    temperature: float,
    score: str,
) -> BeamResult:
    """Walk float32 x [B, n] down the tree keeping `widths[level]` candidates per level.

    A list shorter than the tree's depth reuses its last width. Returns (prototype index
    [B, W] int64, -1 where a row keeps fewer; log-weight [B, W] float64, -inf there; squared
    distance to each leaf [B, W] float32; distance evaluations [B] int64), W the last width.
    """
    b, n = x.shape
    m = index.num_internal
    if m == 0:
        diff = x - index.nodes[0]
        return (
            torch.zeros((b, 1), dtype=torch.long),
            torch.zeros((b, 1), dtype=torch.float64),
            (diff * diff).sum(dim=1, keepdim=True),
            torch.zeros(b, dtype=torch.long),
        )
    nu = index.children.shape[1]
    widest = max(widths)
    step = max(1, _CHUNK_ELEMENTS // max(1, widest * nu * n))
    parts = [
        _walk_chunk(x[lo : lo + step], index, widths, temperature, score)
        for lo in range(0, b, step)
    ]
    leaves, logw, sq, evals = (torch.cat([p[i] for p in parts]) for i in range(4))
    return leaves, logw, sq, evals


def _walk_chunk(
    x: torch.Tensor, index: WalkIndex, widths: Sequence[int], temperature: float, score: str
) -> BeamResult:
    b, n = x.shape
    m = index.num_internal
    nu = index.children.shape[1]
    node = torch.zeros((b, 1), dtype=torch.long)  # the root
    logw = torch.zeros((b, 1), dtype=torch.float64)
    sq = torch.zeros((b, 1), dtype=torch.float32)
    evals = torch.zeros(b, dtype=torch.long)
    level = 0
    while bool(((node >= 0) & (node < m)).any()):
        width = widths[min(level, len(widths) - 1)]
        level += 1
        w = node.shape[1]
        internal = (node >= 0) & (node < m)
        is_leaf = node >= m
        ch = index.children.index_select(0, node.clamp(0, m - 1).flatten()).view(b, w, nu)
        valid = (ch >= 0) & internal[:, :, None]
        # Gathered and reduced as greedy_walk does ([rows, ν, n], sum over n), so the
        # float32 distances are the walk's, bit for bit.
        diff = index.nodes.index_select(0, ch.clamp(min=0).flatten()).view(b * w, nu, n)
        diff -= x.repeat_interleave(w, dim=0)[:, None, :]
        diff.mul_(diff)
        d = diff.sum(dim=2).view(b, w, nu)
        evals += valid.sum(dim=(1, 2))
        s = d.to(torch.float64)
        if score == "dist":
            s = s.sqrt()
        logits = (-s / temperature).masked_fill(~valid, float("-inf"))
        # A parent with no valid child (a leaf, or padding) would give NaN: its row is unused.
        level_logw = torch.log_softmax(logits.masked_fill(~internal[:, :, None], 0.0), dim=2)
        cand_logw = (logw[:, :, None] + level_logw).masked_fill(~valid, float("-inf"))
        cand_node = ch.masked_fill(~valid, -1)
        cand_sq = d.masked_fill(~valid, float("inf"))
        # A leaf already in the beam stays a candidate as it is, in its first slot.
        cand_logw[:, :, 0] = torch.where(is_leaf, logw, cand_logw[:, :, 0])
        cand_node[:, :, 0] = torch.where(is_leaf, node, cand_node[:, :, 0])
        cand_sq[:, :, 0] = torch.where(is_leaf, sq, cand_sq[:, :, 0])
        flat_logw = cand_logw.view(b, w * nu)
        flat_node = cand_node.view(b, w * nu)
        flat_sq = cand_sq.view(b, w * nu)
        # Best log-weight first; among equal ones the smaller distance, then the lower slot
        # (two stable sorts, the secondary key first): the greedy walk's tie rule.
        order = torch.argsort(flat_sq, dim=1, stable=True)
        order = order.gather(1, torch.argsort(-flat_logw.gather(1, order), dim=1, stable=True))
        keep = order[:, : min(width, w * nu)]
        logw = flat_logw.gather(1, keep)
        node = flat_node.gather(1, keep).masked_fill(torch.isinf(logw), -1)
        sq = flat_sq.gather(1, keep)
    leaves = torch.where(node >= m, index.leaf_proto[(node - m).clamp(min=0)], -1)
    return leaves, logw, sq, evals
