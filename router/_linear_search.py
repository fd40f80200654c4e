"""Exact top-k of a lifted linear router by branch-and-bound on the logits themselves.

On lifted points (router/_lift.py) ‖x̃ − w̃ᵢ‖² = ‖x‖² + 1 + M − 2·logitᵢ: the constant dwarfs
the logits' spread, every lifted distance is about √(‖x‖² + 1 + M), and the Euclidean
ball/bisector bounds of `exact` mode stop separating subtrees (it ends up scanning all K).
This search bounds the logits directly (Ram & Gray 2012's ball bound for inner products):
a subtree whose members lie within r of its point c satisfies, for q = [x, 1],

    c_wb·q − r‖q‖  ≤  logitᵢ = (wᵢ, bᵢ)·q  ≤  c_wb·q + r‖q‖,

c_wb being c's (w, b) coordinates. A subtree with at least k members guarantees k logits
above its lower bound; any subtree whose upper bound is below the best such guarantee
(minus a slack far above float64 rounding) cannot hold a top-k expert and is dropped. The
survivors are ranked by float64 direct lifted squared distances, ties to the lowest index,
exactly as the scan ranks them, so the answer (experts, distances, weights) is the one
`PrototypeTree.gate` gives on lifted rows in exact mode.

`LinearGateRouter` takes rows in input space; everything but exact top-k (tree mode, beams)
is `PrototypeTree.gate` on lifted rows. The search evaluates far fewer (query, node) pairs
than a scan on clustered routers (≈ 3,900 of K = 10⁵ on benchmarks/linear_gate.py's
clustered n = 16 router) but each costs about 100 scanned prototypes (gathers and float64
arithmetic against one matmul row; measured on the 2-core VM), so with search="auto" the
first searched chunk decides for the router's life: it keeps searching only if its
evaluations × _PAIR_COST stay below K. Either way the answers are the same, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from ._bruteforce import sq_dist_rows
from ._exact import MIN_TREE_SEARCH
from ._gate import Gate, GateRouting, check_gate, sparsify
from ._lift import LIFT_EXTRA_DIMS, lift_rows
from ._routing import to_inputs

__all__ = ["LinearGateRouter"]

# Relative slack of every bound comparison (the logits are float64 sums of float32 products).
_SLACK = 1e-9
# Queries per search chunk, and the frontier (pairs per query) past which a chunk gives up
# and is scanned instead: K / _GIVE_UP pairs per query.
_CHUNK = 256
_GIVE_UP = 8
# One search pair costs about this many scanned prototypes (2-core VM, K = 10⁵, n = 16).
_PAIR_COST = 100


class LinearGateRouter:
    """A lifted PrototypeTree served on input-space rows; exact top-k by logit bounds."""

    def __init__(self, tree: Any, *, search: str = "auto") -> None:
        """search: "auto" (a pilot decides, see the module doc), "always" or "never"."""
        if search not in ("auto", "always", "never"):
            raise ValueError(f"search must be auto, always or never, got {search!r}")
        self.tree = tree
        self._pays: bool | None = {"auto": None, "always": True, "never": False}[search]
        index = tree._exact_index()
        m = index.num_internal
        n1 = tree.dim - LIFT_EXTRA_DIMS + 1
        nodes = index.nodes64
        self._m = m
        self._children = index.children
        self._leaf_proto = index.leaf_proto
        self._wb = nodes[:, :n1].contiguous()  # [m + K, n + 1] float64
        # The covering radius in lifted space bounds the (w, b) one; a bottom-up bound in
        # (w, b) alone is often tighter (the lift's last coordinates spread the points).
        radius = index.radius.clone()
        size = torch.ones(nodes.shape[0], dtype=torch.long)
        size[:m] = 0
        levels: list[torch.Tensor] = []
        frontier = torch.zeros(1 if m else 0, dtype=torch.long)
        while frontier.numel():
            levels.append(frontier)
            ch = index.children[frontier]
            frontier = ch[(ch >= 0) & (ch < m)]
        for level in reversed(levels):  # deepest internal nodes first
            ch = index.children[level]
            valid = ch >= 0
            c = ch.clamp(min=0)
            gap = ((self._wb[c] - self._wb[level][:, None, :]) ** 2).sum(dim=2).sqrt()
            gap = (gap + radius[c]).masked_fill(~valid, -float("inf"))
            radius[level] = torch.minimum(radius[level], gap.max(dim=1).values)
            size[level] = (size[c] * valid).sum(dim=1)
        self._radius = radius
        self._size = size
        self._scale = float((self._wb * self._wb).sum(dim=1).max().sqrt()) + 1.0

    @property
    def num_prototypes(self) -> int:
        return int(self.tree.num_prototypes)

    @property
    def dim(self) -> int:
        return int(self.tree.dim) - LIFT_EXTRA_DIMS

    @property
    def depth(self) -> int:
        return int(self.tree.depth)

    def gate(self, x: Any, gate: Gate) -> GateRouting:
        gate = check_gate(gate, self.num_prototypes)
        xs = to_inputs(x, self.dim)
        lifted = lift_rows(xs)
        if gate.mode != "exact" or gate.beam is not None or self.num_prototypes <= MIN_TREE_SEARCH:
            return self.tree.gate(lifted, gate)  # type: ignore[no-any-return]
        k = gate.top_k
        parts = [self._chunk(lifted[lo : lo + _CHUNK], k, gate)
                 for lo in range(0, xs.shape[0], _CHUNK)]
        return GateRouting.concat(parts)

    def _chunk(self, lifted: torch.Tensor, k: int, gate: Gate) -> GateRouting:
        found = None if self._pays is False else self._search(lifted, k)
        if self._pays is None:
            cost = None if found is None else float(found[2].double().mean()) * _PAIR_COST
            self._pays = cost is not None and cost < self.num_prototypes
        if found is None:
            return self.tree.gate(lifted, gate)  # type: ignore[no-any-return]
        experts, d2, evals = found
        b = lifted.shape[0]
        if k == 1:
            weights = torch.ones((b, 1), dtype=torch.float64)
        else:
            s = d2.sqrt() if gate.score == "dist" else d2
            weights = torch.softmax(-s / gate.temperature, dim=1)
        distances = d2.sqrt().to(torch.float32)
        experts, weights, distances = sparsify(experts, weights, distances, gate)
        return GateRouting(experts, weights, distances, evals)

    def _search(
        self, lifted: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(prototypes [B, k], float64 lifted sq distances [B, k], evaluations [B]), or None
        when the frontier grows past K / _GIVE_UP pairs per query (then scan)."""
        b = lifted.shape[0]
        m = self._m
        n1 = self._wb.shape[1]
        q = lifted[:, :n1]  # [x, 1]
        qn = (q * q).sum(dim=1).sqrt()
        slack = _SLACK * (qn * self._scale + 1.0)
        evals = torch.zeros(b, dtype=torch.long)
        threshold = torch.full((b,), -float("inf"), dtype=torch.float64)
        rows = torch.arange(b)
        nodes = torch.zeros(b, dtype=torch.long)  # every query starts at the root
        cand_rows: list[torch.Tensor] = []
        cand_nodes: list[torch.Tensor] = []
        limit = b * max(k, self.num_prototypes // _GIVE_UP)
        while rows.numel():
            ch = self._children[nodes]  # [P, ν]
            valid = ch >= 0
            rows = rows[:, None].expand_as(ch)[valid]
            nodes = ch[valid]
            if rows.numel() > limit:
                return None
            evals.index_add_(0, rows, torch.ones_like(rows))
            centre = (self._wb[nodes] * q[rows]).sum(dim=1)
            reach = self._radius[nodes] * qn[rows]
            # k members at least this high: the threshold any top-k member must reach.
            sure = torch.where(self._size[nodes] >= k, centre - reach, -float("inf"))
            threshold.scatter_reduce_(0, rows, sure, reduce="amax")
            keep = centre + reach >= threshold[rows] - slack[rows]
            rows, nodes = rows[keep], nodes[keep]
            leaf = nodes >= m
            cand_rows.append(rows[leaf])
            cand_nodes.append(nodes[leaf])
            rows, nodes = rows[~leaf], nodes[~leaf]
        crow = torch.cat(cand_rows)
        cnode = torch.cat(cand_nodes)
        # Leaves found before the threshold last rose may have fallen below it since.
        upper = (self._wb[cnode] * q[crow]).sum(dim=1)
        keep = upper >= threshold[crow] - slack[crow]
        crow, cnode = crow[keep], cnode[keep]
        proto = self._leaf_proto[cnode - m]
        d2 = sq_dist_rows(lifted[crow], self.tree.prototypes[proto].to(torch.float64))
        evals.index_add_(0, crow, torch.ones_like(crow))
        # Rank each query's candidates by (d2, prototype index), as the scan does.
        order = torch.argsort(proto, stable=True)
        order = order[torch.argsort(d2[order], stable=True)]
        order = order[torch.argsort(crow[order], stable=True)]
        crow, proto, d2 = crow[order], proto[order], d2[order]
        counts = torch.bincount(crow, minlength=b)
        if int(counts.min()) < k:  # cannot happen with sound bounds; scan rather than guess
            return None
        starts = torch.cumsum(counts, dim=0) - counts
        pick = starts[:, None] + torch.arange(k)[None, :]
        return proto[pick], d2[pick], evals
