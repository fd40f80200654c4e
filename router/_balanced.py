"""Balanced construction of the prototype tree: capacity-constrained k-means splits.

The default build (`_build.py`) splits each node into the Voronoi cells of k-means centres,
so cells can be lopsided and a greedy walk may pass more than ⌈log_ν K⌉ levels. Here every
internal node with m > ν members splits them into ν groups of at most ⌈m/ν⌉ members each
(k-means++ seeds, then rounds of capacity-constrained assignment and mean updates). Since
⌈log_ν ⌈m/ν⌉⌉ = ⌈log_ν m⌉ − 1, the tree has exactly ⌈log_ν K⌉ levels of internal nodes and
a greedy walk costs at most ν⌈log_ν K⌉ distance evaluations per row.

The price: a group is no longer the Voronoi cell of its point among its siblings, so the
bisector bound of exact search does not hold for these trees (ExactIndex drops it; the ball
bound still does). Nodes are split one at a time, so building is slower than the batched
default (fine for the small per-node trees of graph stores). Measured on the 2-core VM with
one torch thread, n = 4: K = 2,000 in 0.3 s, K = 20,000 in 3.6 s (default build: 0.02 s,
0.15 s); the ops are tiny, so more threads on a loaded machine only slow it (17 s at K = 2,000).
"""

from __future__ import annotations

from collections import deque

import torch

from ._build import TreeArrays, _kmeans_pp, build_tree_arrays, leaf_encode

__all__ = ["balanced_depth", "build_balanced_arrays"]

_ROUNDS = 12  # assignment / mean-update rounds per split (stops early once stable)


def balanced_depth(num_prototypes: int, branching: int) -> int:
    """⌈log_ν K⌉ computed in integers (float log rounds badly at exact powers)."""
    depth, reach = 0, 1
    while reach < num_prototypes:
        reach *= branching
        depth += 1
    return depth


def _capacity_assign(d2: torch.Tensor, cap: int) -> torch.Tensor:
    """Each row to a centre, no centre over `cap` rows, nearest first (deferred acceptance).

    Every free row proposes to its nearest centre that still has room; a centre keeps its
    closest proposers (ties: lower row) up to its room and is closed once full. Each round
    assigns everyone or closes a centre, so it ends within ν rounds; m ≤ ν·cap guarantees
    room for everyone.
    """
    m, nu = d2.shape
    labels = torch.full((m,), -1, dtype=torch.long)
    room = torch.full((nu,), cap, dtype=torch.long)
    cost = d2.clone()
    while True:
        rows = torch.nonzero(labels < 0).flatten()
        if rows.numel() == 0:
            return labels
        dist, choice = cost[rows].min(dim=1)
        by_dist = torch.argsort(dist, stable=True)
        order = by_dist[torch.argsort(choice[by_dist], stable=True)]
        counts = torch.bincount(choice, minlength=nu)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel()) - first[choice[order]]
        accept = rank < room[choice]
        labels[rows[accept]] = choice[accept]
        room -= torch.bincount(choice[accept], minlength=nu)
        cost[:, room <= 0] = float("inf")


def _balanced_split(x: torch.Tensor, nu: int, gen: torch.Generator) -> torch.Tensor:
    """Labels [m] in [0, nu) of a split of x [m, n] float64 into groups of ≤ ⌈m/ν⌉ rows."""
    m = x.shape[0]
    cap = -(-m // nu)
    seg = torch.zeros(m, dtype=torch.long)
    centres = _kmeans_pp(x, seg, torch.zeros(1, dtype=torch.long),
                         torch.full((1,), m, dtype=torch.long), nu, gen)[0]
    labels = torch.full((m,), -1, dtype=torch.long)
    for _ in range(_ROUNDS):
        d2 = ((x[:, None, :] - centres[None]) ** 2).sum(dim=2)
        new = _capacity_assign(d2, cap)
        if bool((new == labels).all()):
            break
        labels = new
        sums = torch.zeros_like(centres).index_add_(0, labels, x)
        counts = torch.bincount(labels, minlength=nu).to(torch.float64)
        filled = counts > 0
        centres[filled] = sums[filled] / counts[filled, None]
    return labels


def _radius(point: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    return ((members - point.to(torch.float64)) ** 2).sum(dim=1).max().sqrt()


def build_balanced_arrays(prototypes: torch.Tensor, branching: int, seed: int) -> TreeArrays:
    """The balanced tree over float32 prototypes [K, n]; deterministic for a seed."""
    k_total = prototypes.shape[0]
    if k_total == 1:  # no internal nodes: the same (empty) tree either way
        return build_tree_arrays(prototypes, branching, seed)
    nu = branching
    x_all = prototypes.to(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    root = x_all.mean(dim=0).to(torch.float32)
    points = [root]
    radii = [_radius(root, x_all)]
    rows: list[torch.Tensor] = []
    queue: deque[torch.Tensor] = deque([torch.arange(k_total)])
    # Breadth-first: node i's row is rows[i]; a new internal node's id is len(points).
    while queue:
        members = queue.popleft()
        row = torch.full((nu,), -1, dtype=torch.long)
        if members.numel() <= nu:
            row[: members.numel()] = leaf_encode(members)
            rows.append(row)
            continue
        labels = _balanced_split(x_all[members], nu, gen)
        groups = [members[labels == c] for c in range(nu)]
        # Slots by lowest member, as the default build: walk ties lean to low indices.
        groups = sorted((g for g in groups if g.numel() > 0), key=lambda g: int(g.min()))
        for slot, group in enumerate(groups):
            if group.numel() == 1:
                row[slot] = leaf_encode(group)[0]
                continue
            point = x_all[group].mean(dim=0).to(torch.float32)
            row[slot] = len(points)
            points.append(point)
            radii.append(_radius(point, x_all[group]))
            queue.append(group)
        rows.append(row)
    children = torch.stack(rows)
    m = children.shape[0]
    leaf = children < -1
    children[leaf] = m + (-children[leaf] - 2)
    return TreeArrays(torch.stack(points), torch.stack(radii), children)
