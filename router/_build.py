"""Top-down construction of the prototype tree by batched k-means.

Every node of one level is split at once (one tensor program per Lloyd step for the whole
level), so building K = 10^5 prototypes costs a few seconds instead of one Python k-means
per node. A node's children are the Voronoi cells of the final, float32-rounded sibling
centres: each member goes to its nearest centre computed in float64 from those very
centres, which is what makes the bisector bound of exact routing valid.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ._exceptions import RouterBuildError

__all__ = ["TreeArrays", "build_tree_arrays", "leaf_encode"]

logger = logging.getLogger(__name__)

_LLOYD_STEPS = 12
# Rows per chunk so that a gathered [rows, branching, n] float64 block stays near 32 MB.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class TreeArrays:
    """Internal nodes in breadth-first order (root = 0, a child's id > its parent's).

    children[i, j] is the id of the j-th child of internal node i, -1 past its last child;
    ids < num_internal are internal nodes, id num_internal + p is the leaf of prototype p.
    """

    points: torch.Tensor  # float32 [num_internal, n]
    radius: torch.Tensor  # float64 [num_internal], max distance from the point to its leaves
    children: torch.Tensor  # int64 [num_internal, branching]


def leaf_encode(prototype: torch.Tensor) -> torch.Tensor:
    # Leaves are encoded negative until the number of internal nodes is known.
    return -(prototype + 2)


def _sq_dist_to_centres(x: torch.Tensor, centres: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """[m, nu] float64 squared distances of each row to the centres of its own segment."""
    m, n = x.shape
    nu = centres.shape[1]
    out = torch.empty((m, nu), dtype=x.dtype)
    flat = centres.reshape(centres.shape[0], nu * n)
    step = max(1, _CHUNK_ELEMENTS // max(1, nu * n))
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        diff = flat.index_select(0, seg[lo:hi]).view(hi - lo, nu, n)
        diff -= x[lo:hi, None, :]
        diff.mul_(diff)
        out[lo:hi] = diff.sum(dim=2)
    return out


def _kmeans_pp(
    x: torch.Tensor, seg: torch.Tensor, start: torch.Tensor, size: torch.Tensor, nu: int,
    gen: torch.Generator,
) -> torch.Tensor:
    """k-means++ seeding of every segment at once: centres [S, nu, n]."""
    s_count = start.shape[0]
    n = x.shape[1]
    centres = torch.empty((s_count, nu, n), dtype=torch.float64)
    first = start + (torch.rand(s_count, generator=gen, dtype=torch.float64) * size).long()
    first = torch.minimum(first, start + size - 1)
    centres[:, 0] = x[first]
    diff = x - centres[seg, 0]
    d2 = (diff * diff).sum(dim=1)
    for c in range(1, nu):
        cum = torch.cumsum(d2, dim=0)
        end = start + size - 1
        before = torch.where(start > 0, cum[(start - 1).clamp(min=0)], torch.zeros_like(cum[end]))
        total = cum[end] - before
        r = torch.rand(s_count, generator=gen, dtype=torch.float64)
        pick = torch.searchsorted(cum, before + r * total, right=True)
        # A segment whose points all coincide with chosen centres has total 0: any member will do.
        uniform = start + (r * size).long()
        pick = torch.where(total > 0, pick, uniform)
        pick = torch.minimum(torch.maximum(pick, start), end)
        centres[:, c] = x[pick]
        diff = x - centres[seg, c]
        d2 = torch.minimum(d2, (diff * diff).sum(dim=1))
    return centres


def _lloyd(
    x: torch.Tensor, seg: torch.Tensor, centres: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd steps; distances in float32 (only the final assignment must be exact)."""
    s_count, nu, n = centres.shape
    x32 = x.to(torch.float32)
    labels = torch.full((x.shape[0],), -1, dtype=torch.long)
    for _ in range(steps):
        new_labels = _sq_dist_to_centres(x32, centres.to(torch.float32), seg).argmin(dim=1)
        if bool((new_labels == labels).all()):
            break
        labels = new_labels
        slot = seg * nu + labels
        sums = torch.zeros((s_count * nu, n), dtype=torch.float64).index_add_(0, slot, x)
        counts = torch.bincount(slot, minlength=s_count * nu).to(torch.float64)
        filled = counts > 0
        flat = centres.reshape(s_count * nu, n).clone()
        # An emptied cluster keeps its old centre; the final assignment drops it if still empty.
        flat[filled] = sums[filled] / counts[filled, None]
        centres = flat.reshape(s_count, nu, n)
    return centres, labels


def _order_by_lowest_member(
    labels: torch.Tensor, members: torch.Tensor, seg: torch.Tensor, centres: torch.Tensor
) -> torch.Tensor:
    """Sort each segment's centres by the lowest prototype index in their cells.

    Walks break ties towards the lowest child slot; with children in this order a tie
    leans towards the lower prototype indices, as the flat Voronoi partition does.
    """
    s_count, nu, _ = centres.shape
    lowest = torch.full((s_count * nu,), torch.iinfo(torch.long).max, dtype=torch.long)
    lowest.scatter_reduce_(0, seg * nu + labels, members, reduce="amin")
    perm = torch.argsort(lowest.reshape(s_count, nu), dim=1, stable=True)
    return centres.gather(1, perm[:, :, None].expand_as(centres))


def _fallback_split(x: torch.Tensor, nu: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one segment that k-means left whole: (labels [m], centres [nu', n] float64)."""
    d_first = ((x - x[0]) ** 2).sum(dim=1)
    if float(d_first.max()) == 0.0:
        # All members coincide: any split is a Voronoi split (ties); cut by index order.
        m = x.shape[0]
        parts = min(nu, m)
        labels = torch.arange(m) * parts // m
        return labels, x[:parts].clone()
    far = int(d_first.argmax())
    centres = torch.stack([x[0], x[far]])
    d = ((x[:, None, :] - centres[None]) ** 2).sum(dim=2)
    return d.argmin(dim=1), centres


def build_tree_arrays(
    prototypes: torch.Tensor, branching: int, seed: int
) -> TreeArrays:
    """Build the tree over float32 prototypes [K, n]; deterministic for a seed."""
    k_total, n = prototypes.shape
    nu = branching
    x_all = prototypes.to(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    if k_total == 1:
        empty = torch.zeros((0,), dtype=torch.float64)
        return TreeArrays(
            prototypes.new_zeros((0, n)), empty, torch.zeros((0, nu), dtype=torch.long)
        )
    centroid = x_all.mean(dim=0).to(torch.float32)
    root_r = ((x_all - centroid.to(torch.float64)) ** 2).sum(dim=1).max().sqrt()
    points: list[torch.Tensor] = [centroid[None]]
    radii: list[torch.Tensor] = [root_r.reshape(1)]
    child_rows: list[torch.Tensor] = []
    members = torch.arange(k_total)
    start = torch.zeros(1, dtype=torch.long)
    size = torch.full((1,), k_total, dtype=torch.long)
    next_id = 1
    level = 0
    while start.numel() > 0:
        g = start.numel()
        seg = torch.repeat_interleave(torch.arange(g), size)
        pos = torch.arange(members.numel()) - start[seg]
        rows = torch.full((g, nu), -1, dtype=torch.long)
        small = size <= nu
        in_small = small[seg]
        rows[seg[in_small], pos[in_small]] = leaf_encode(members[in_small])
        big = torch.nonzero(~small).flatten()
        if big.numel() == 0:
            child_rows.append(rows)
            break
        in_big = ~in_small
        b_members = members[in_big]
        b_seg_old = seg[in_big]
        remap = torch.full((g,), -1, dtype=torch.long)
        remap[big] = torch.arange(big.numel())
        b_seg = remap[b_seg_old]
        b_size = size[big]
        b_start = torch.cumsum(b_size, 0) - b_size
        xb = x_all[b_members]
        centres = _kmeans_pp(xb, b_seg, b_start, b_size, nu, gen)
        centres, lloyd_labels = _lloyd(xb, b_seg, centres, _LLOYD_STEPS)
        # Round the centres to what is stored, then assign exactly against the stored values.
        centres = centres.to(torch.float32).to(torch.float64)
        centres = _order_by_lowest_member(lloyd_labels, b_members, b_seg, centres)
        d2 = _sq_dist_to_centres(xb, centres, b_seg)
        labels = d2.argmin(dim=1)
        slot = b_seg * nu + labels
        counts = torch.bincount(slot, minlength=big.numel() * nu).reshape(-1, nu)
        whole = torch.nonzero((counts > 0).sum(dim=1) < 2).flatten().tolist()
        if whole:
            for s in whole:
                lo, hi = int(b_start[s]), int(b_start[s] + b_size[s])
                lab, cen = _fallback_split(xb[lo:hi], nu)
                labels[lo:hi] = lab
                centres[s] = 0.0
                centres[s, : cen.shape[0]] = cen
            slot = b_seg * nu + labels
            counts = torch.bincount(slot, minlength=big.numel() * nu).reshape(-1, nu)
            d2 = _sq_dist_to_centres(xb, centres, b_seg)
        d2_own = d2.gather(1, labels[:, None]).squeeze(1)
        # Non-empty clusters take consecutive child slots in label order.
        filled = counts > 0
        child_slot = torch.cumsum(filled.long(), dim=1) - 1
        member_slot = child_slot[b_seg, labels]
        single = counts == 1
        is_leaf_member = single[b_seg, labels]
        parent_rows = big[b_seg]
        rows[parent_rows[is_leaf_member], member_slot[is_leaf_member]] = leaf_encode(
            b_members[is_leaf_member]
        )
        inner = counts >= 2  # [S, nu] clusters that become internal nodes, in BFS order
        n_new = int(inner.sum())
        new_ids = torch.full((big.numel(), nu), -1, dtype=torch.long)
        new_ids[inner] = torch.arange(next_id, next_id + n_new)
        s_idx, l_idx = torch.nonzero(inner, as_tuple=True)
        rows[big[s_idx], child_slot[s_idx, l_idx]] = new_ids[s_idx, l_idx]
        max_d2 = torch.zeros(big.numel() * nu, dtype=torch.float64).scatter_reduce_(
            0, slot, d2_own, reduce="amax"
        )
        points.append(centres[s_idx, l_idx].to(torch.float32))
        radii.append(max_d2.reshape(-1, nu)[s_idx, l_idx].sqrt())
        child_rows.append(rows)
        # Next level: members of new internal nodes, grouped by node id, by prototype index.
        member_node = new_ids[b_seg, labels]
        keep = member_node >= 0
        order = torch.argsort(member_node[keep] * k_total + b_members[keep])
        members = b_members[keep][order]
        size = counts[inner]
        start = torch.cumsum(size, 0) - size
        next_id += n_new
        level += 1
        logger.debug("tree level %s: %s internal nodes", level, n_new)
    children = torch.cat(child_rows, dim=0)
    num_internal = children.shape[0]
    if num_internal != next_id:
        raise RouterBuildError(f"internal error: {num_internal} rows for {next_id} nodes")
    leaf = children < -1
    children[leaf] = num_internal + (-children[leaf] - 2)
    return TreeArrays(torch.cat(points, dim=0), torch.cat(radii, dim=0), children)
