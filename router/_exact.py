"""`exact` mode: batched branch-and-bound over the tree, with a blocked brute-force escape.

The search keeps, for every query, a frontier of subtrees that may still hold its nearest
prototype and expands all frontiers of the batch together, one level per step. A subtree
is dropped when a lower bound on its distance exceeds the query's upper bound:

- ball bound: d(q, c) - r, r the covering radius of the subtree's point c;
- bisector bound: (d(q, c_i)^2 - d(q, c_j)^2) / (2 |c_i - c_j|) against the nearest
  sibling c_j, valid because a node's members are exactly the Voronoi cell of its point
  among its siblings (not for balanced trees, whose groups are not Voronoi cells: there
  the index carries voronoi=False and only the ball bound prunes).

Bounds are compared with a relative slack far above float64 rounding, so a prototype tied
with (or a hair closer than) the best is never pruned; leaf distances are float64 direct
differences, so the answer equals a float64 brute-force scan, ties to the lowest index.
Queries whose frontier stays large (high intrinsic dimension) leave the search and are
answered by the blocked brute force, so exact mode is never much slower than a scan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._bruteforce import BlockedSearch, sq_dist_rows
from ._walk import WalkIndex

__all__ = ["ExactIndex", "Seeder", "exact_nearest", "search_pays"]

_SLACK = 1e-10
# Pairs per chunk so that a gathered [pairs, branching, n] float64 block stays near 32 MB.
_CHUNK_ELEMENTS = 1 << 22
# One tree evaluation (a random row gather plus bound arithmetic) costs about as much as
# scanning this many prototypes (measured on the 2-core development VM, n = 16 and 128).
_EVAL_COST = 64
# A query leaves the tree search once its evaluations would pass K / _SWITCH_FRACTION,
# so a query that gives up has wasted at most half a scan.
_SWITCH_FRACTION = 2 * _EVAL_COST
# Below this many prototypes a scan is always cheaper than the search's fixed costs.
MIN_TREE_SEARCH = 2048
# Queries searched before the batch commits to the tree search or to the scan: a small
# share of the batch, so that a wrong guess costs little.
_PILOT_MIN = 16
_PILOT_SHARE = 32


def search_pays(num_prototypes: int, branching: int, depth: int) -> bool:
    """Whether a tree search can beat a scan at all: K is large enough that the allowed
    evaluations (K / switch fraction) cover at least the seeding root-to-leaf walk."""
    if num_prototypes <= MIN_TREE_SEARCH:
        return False
    return num_prototypes / _SWITCH_FRACTION >= branching * depth


@dataclass(frozen=True)
class ExactIndex:
    """The tree rearranged for search: leaves renumbered in breadth-first order, so the
    children of a node sit in consecutive rows and a level's gathers stay cache-friendly."""

    nodes64: torch.Tensor  # [num_internal + K, n] float64, internal points then leaves
    nodes32: torch.Tensor  # the same rows minus centre, in float32: the search's fast copy
    centre: torch.Tensor  # [n] float64
    max_norm: float  # max |node - centre|
    leaf_proto: torch.Tensor  # [K] int64, prototype index of leaf row num_internal + i
    radius: torch.Tensor  # [num_internal + K] float64, 0 for leaves
    children: torch.Tensor  # [num_internal, branching] int64, -1 padded
    sibling_flat: torch.Tensor  # [num_internal * branching^2] float64 |c_i - c_j|, flattened
    num_internal: int
    voronoi: bool = True  # whether the bisector bound holds (children are Voronoi cells)

    @classmethod
    def from_walk(
        cls, walk: WalkIndex, radius: torch.Tensor, *, voronoi: bool = True
    ) -> ExactIndex:
        """Reuse the walk's layout (leaves in breadth-first order), in float64."""
        m = walk.num_internal
        nodes64 = walk.nodes.to(torch.float64)
        k = nodes64.shape[0] - m
        radius_all = torch.cat([radius.to(torch.float64), torch.zeros(k, dtype=torch.float64)])
        children = walk.children
        nu = children.shape[1]
        sibling = torch.empty((m, nu, nu), dtype=torch.float64)
        step = max(1, _CHUNK_ELEMENTS // max(1, nu * nu * nodes64.shape[1]))
        for lo in range(0, m, step):
            c = nodes64[children[lo : lo + step].clamp(min=0)]
            diff = c[:, :, None, :] - c[:, None, :, :]
            sibling[lo : lo + step] = (diff * diff).sum(dim=3).sqrt()
        centre = nodes64.mean(dim=0)
        centred = nodes64 - centre
        max_norm = float((centred * centred).sum(dim=1).max().sqrt())
        return cls(
            nodes64, centred.to(torch.float32), centre, max_norm, walk.leaf_proto, radius_all,
            children, sibling.flatten(), m, voronoi,
        )


Seeder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def exact_nearest(
    x: torch.Tensor,
    seed: Seeder,
    index: ExactIndex,
    search: BlockedSearch,
    *,
    min_tree_search: int = MIN_TREE_SEARCH,
    switch_fraction: float = _SWITCH_FRACTION,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nearest prototype of float64 x [B, n].

    seed(rows) gives, for the queries at `rows`, a known prototype, its float64 squared
    distance and the evaluations spent finding it (the greedy walk); it is called only for
    queries that the tree search will start from. Returns (prototype index [B], float64
    squared distance [B], evaluations [B]). Below min_tree_search prototypes every query
    is scanned; a query leaves the tree search once its evaluations would pass
    K / switch_fraction (0 never switches). A pilot of the first queries decides for the
    batch: if searching them cost more than scanning them would have, the rest are scanned
    straight away, without walking the tree for them.
    """
    b = x.shape[0]
    k_total = index.nodes64.shape[0] - index.num_internal
    if index.num_internal == 0:
        return seed(torch.arange(b))  # a single leaf: the walk's answer is the answer
    if k_total <= min_tree_search:
        idx, d2 = search.knn(x, 1)
        return idx[:, 0], d2[:, 0], torch.full((b,), k_total, dtype=torch.long)
    best_idx = torch.empty(b, dtype=torch.long)
    best_d2 = torch.empty(b, dtype=torch.float64)
    evals = torch.zeros(b, dtype=torch.long)
    to_scan = torch.zeros(b, dtype=torch.bool)
    budget = k_total / switch_fraction if switch_fraction > 0 else float("inf")
    # The pilot is spread over the batch: its first rows may not be typical.
    pilot_count = min(b, max(_PILOT_MIN, b // _PILOT_SHARE))
    in_pilot = torch.zeros(b, dtype=torch.bool)
    in_pilot[torch.linspace(0, b - 1, pilot_count).round().long()] = True
    pilot = torch.nonzero(in_pilot).flatten()
    spent = _search_rows(x, pilot, seed, best_idx, best_d2, evals, to_scan, index, budget)
    spent += float(to_scan[pilot].sum()) * k_total
    rest = torch.nonzero(~in_pilot).flatten()
    if switch_fraction > 0 and spent > pilot.numel() * k_total:
        to_scan[rest] = True
    elif rest.numel() > 0:
        _search_rows(x, rest, seed, best_idx, best_d2, evals, to_scan, index, budget)
    if bool(to_scan.any()):
        rows = torch.nonzero(to_scan).flatten()
        idx, d2 = search.knn(x[rows], 1)
        best_idx[rows] = idx[:, 0]
        best_d2[rows] = d2[:, 0]
        evals[rows] += k_total
    return best_idx, best_d2, evals


def _search_rows(
    x: torch.Tensor,
    rows: torch.Tensor,
    seed: Seeder,
    best_idx: torch.Tensor,
    best_d2: torch.Tensor,
    evals: torch.Tensor,
    to_scan: torch.Tensor,
    index: ExactIndex,
    budget: float,
) -> float:
    """Seed and search the given rows, write their results back; return the search's cost
    in scan units (the seeding walk not counted: every query that is searched pays it)."""
    sub_idx, sub_d2, sub_evals = seed(rows)
    sub_scan = to_scan[rows]
    before = float(sub_evals.sum())
    _branch_and_bound(x[rows], sub_idx, sub_d2, sub_evals, sub_scan, index, budget)
    best_idx[rows], best_d2[rows], evals[rows], to_scan[rows] = (
        sub_idx, sub_d2, sub_evals, sub_scan,
    )
    return (float(sub_evals.sum()) - before) * _EVAL_COST


def _branch_and_bound(
    x: torch.Tensor,
    best_idx: torch.Tensor,
    best_d2: torch.Tensor,
    evals: torch.Tensor,
    to_scan: torch.Tensor,
    index: ExactIndex,
    budget: float,
) -> None:
    """Update best_idx / best_d2 / evals / to_scan in place.

    Node distances are measured in float32 on centred coordinates (half the memory
    traffic of float64) and every bound is widened by that rounding error: rel * d plus
    abs_q, which covers rounding x and the nodes into float32.
    """
    b = x.shape[0]
    nu = index.children.shape[1]
    n = x.shape[1]
    m = index.num_internal
    slots = torch.arange(nu)
    xc = x - index.centre
    x32 = xc.to(torch.float32)
    unit = 2.0**-24
    rel = (n + 8) * 2 * unit
    abs_q = (4 * unit * ((xc * xc).sum(dim=1).sqrt() + index.max_norm))[:, None]
    ub = best_d2.sqrt()
    fq = torch.arange(b)
    fnode = torch.zeros(b, dtype=torch.long)
    step = max(1, _CHUNK_ELEMENTS // max(1, nu * n))
    while fq.numel() > 0:
        next_q: list[torch.Tensor] = []
        next_node: list[torch.Tensor] = []
        for lo in range(0, fq.numel(), step):
            q = fq[lo : lo + step]
            node = fnode[lo : lo + step]
            p = q.numel()
            ch = index.children.index_select(0, node)
            valid = ch >= 0
            flat = ch.clamp(min=0).flatten()
            diff = index.nodes32.index_select(0, flat).view(p, nu, n)
            diff -= x32.index_select(0, q)[:, None, :]
            diff *= diff
            d = diff.sum(dim=2).to(torch.float64).sqrt_()
            d.masked_fill_(~valid, float("inf"))
            evals.index_add_(0, q, valid.sum(dim=1))
            err = rel * d + abs_q.index_select(0, q)
            d_lo = (d - err).clamp_(min=0.0)
            d_hi = d + err
            _update_best(x, index, best_idx, best_d2, q, ch, d_lo, valid & (ch >= m))
            r = index.radius.index_select(0, flat).view(p, nu)
            inner = valid & (ch < m)
            # Any subtree holds a prototype within d + r: a valid upper bound right away.
            reach = torch.where(inner, d_hi + r, torch.full_like(d, float("inf"))).amin(dim=1)
            ub.scatter_reduce_(0, q, reach, reduce="amin")
            ub = torch.minimum(ub, best_d2.sqrt())
            uq = ub.index_select(0, q)[:, None]
            keep = inner & (d_lo - r <= uq + _SLACK * (d + r + uq))
            j = d.argmin(dim=1)
            pick = ((node[:, None] * nu + slots) * nu + j[:, None]).flatten()
            s = index.sibling_flat.index_select(0, pick).view(p, nu)
            dj_hi = d_hi.gather(1, j[:, None])
            slack = _SLACK * (d_hi * d_hi + dj_hi * dj_hi + (r + s) ** 2)
            # A sibling at distance 0 (duplicate points) gives no bisector: skip it.
            if index.voronoi:
                keep &= ~((s > 0) & (d_lo * d_lo - dj_hi * dj_hi > 2.0 * s * uq + slack))
            kq, kslot = torch.nonzero(keep, as_tuple=True)
            next_q.append(q[kq])
            next_node.append(ch[kq, kslot])
        fq = torch.cat(next_q)
        fnode = torch.cat(next_node)
        if fq.numel() == 0:
            break
        # Pairs in node order: neighbouring pairs read neighbouring rows of the tree.
        order = torch.argsort(fnode)
        fq, fnode = fq[order], fnode[order]
        pending = torch.bincount(fq, minlength=b)
        over = (evals + pending * nu > budget) & (pending > 0)
        if bool(over.any()):
            to_scan |= over
            stay = ~over[fq]
            fq, fnode = fq[stay], fnode[stay]


def _update_best(
    x: torch.Tensor,
    index: ExactIndex,
    best_idx: torch.Tensor,
    best_d2: torch.Tensor,
    q: torch.Tensor,
    ch: torch.Tensor,
    d_lo: torch.Tensor,
    is_leaf: torch.Tensor,
) -> None:
    """Fold leaf candidates into the best so far: smaller distance, then lower index.

    Leaves whose lower bound d_lo may win or tie are re-measured with sq_dist_rows, the
    reference metric, so the answer is decided by the same float64 sums as a scan.
    """
    best = best_d2.index_select(0, q)[:, None]
    near = is_leaf & (d_lo * d_lo <= best * (1.0 + _SLACK))
    lq, lslot = torch.nonzero(near, as_tuple=True)
    if lq.numel() == 0:
        return
    cq = q[lq]
    cnode = ch[lq, lslot]
    cidx = index.leaf_proto[cnode - index.num_internal]
    cd2 = sq_dist_rows(x[cq], index.nodes64[cnode])
    new_min = best_d2.clone()
    new_min.scatter_reduce_(0, cq, cd2, reduce="amin")
    big = torch.iinfo(torch.long).max
    idx = torch.where(best_d2 == new_min, best_idx, torch.full_like(best_idx, big))
    on_min = cd2 == new_min[cq]
    idx.scatter_reduce_(0, cq[on_min], cidx[on_min], reduce="amin")
    best_idx.copy_(idx)
    best_d2.copy_(new_min)
