"""PrototypeTree: the ν-ary tree over the K prototypes that routes inputs to experts."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch

from ._balanced import build_balanced_arrays
from ._beam import beam_walk
from ._bruteforce import BlockedSearch, sq_dist_rows
from ._build import TreeArrays, build_tree_arrays
from ._exact import ExactIndex, Seeder, exact_nearest, search_pays
from ._exceptions import RouterBuildError
from ._gate import Gate, GateRouting, check_gate, sparsify
from ._io import read_router, write_router
from ._routing import Mode, Routing, check_mode, check_top_k, gate_weights, to_inputs
from ._walk import WalkIndex, greedy_walk

__all__ = ["PrototypeTree"]

logger = logging.getLogger(__name__)


class PrototypeTree:
    """Prototypes p_0..p_{K-1} in R^n as the leaves of a ν-ary tree of points.

    Build with PrototypeTree.build(), or read one with PrototypeTree.load(). route() sends
    each input to one expert (`tree`: greedy descent; `exact`: the nearest prototype) or,
    with top_k > 1, to the k nearest prototypes with softmax(-d^2 / temperature) weights.
    """

    def __init__(
        self,
        prototypes: torch.Tensor,
        arrays: TreeArrays,
        branching: int,
        temperature: float = 1.0,
        balanced: bool = False,
    ) -> None:
        self.prototypes = prototypes
        self.branching = branching
        self.temperature = float(temperature)
        # Balanced trees' groups are not Voronoi cells: exact search must skip the bisector.
        self.balanced = balanced
        self._arrays = arrays
        self._num_internal = int(arrays.children.shape[0])
        self._walk = WalkIndex.from_tree(arrays.points, prototypes, arrays.children)
        # Levels of internal nodes on the longest root-to-leaf path (0 for K = 1).
        self.depth = self._walk.steps
        self._exact: ExactIndex | None = None
        self._search: BlockedSearch | None = None

    @classmethod
    def build(
        cls,
        prototypes: torch.Tensor | np.ndarray,
        branching: int = 4,
        seed: int = 0,
        temperature: float = 1.0,
        balanced: bool = False,
    ) -> PrototypeTree:
        """Build the tree top-down by k-means; the same inputs and seed give the same tree.

        balanced=True splits every node into ν groups of at most ⌈m/ν⌉ members (see
        router/_balanced.py): depth exactly ⌈log_ν K⌉, so a greedy walk costs at most
        ν⌈log_ν K⌉ distance evaluations per row; the default splits into Voronoi cells.
        """
        if isinstance(branching, bool) or not isinstance(branching, int) or branching < 2:
            raise RouterBuildError(f"branching must be an integer >= 2, got {branching!r}")
        if not (isinstance(temperature, int | float) and math.isfinite(temperature)):
            raise RouterBuildError(f"temperature must be a finite number, got {temperature!r}")
        if temperature <= 0:
            raise RouterBuildError(f"temperature must be > 0, got {temperature!r}")
        p = torch.as_tensor(prototypes).detach().to("cpu")
        if p.dim() != 2 or p.shape[0] < 1 or p.shape[1] < 1:
            raise RouterBuildError(f"prototypes must be [K >= 1, n >= 1], got {list(p.shape)}")
        if p.is_complex() or p.dtype == torch.bool:
            raise RouterBuildError(f"prototypes must be real numbers, got {p.dtype}")
        p32 = p.to(torch.float32).contiguous()
        if not bool(torch.isfinite(p32).all()):
            raise RouterBuildError("prototypes contain NaN or infinite values (in float32)")
        build = build_balanced_arrays if balanced else build_tree_arrays
        tree = cls(p32, build(p32, branching, seed), branching, float(temperature), balanced)
        logger.info(
            "built prototype tree: K=%s n=%s branching=%s depth=%s internal=%s balanced=%s",
            tree.num_prototypes, tree.dim, branching, tree.depth, tree._num_internal, balanced,
        )
        return tree

    @property
    def num_prototypes(self) -> int:
        return int(self.prototypes.shape[0])

    @property
    def dim(self) -> int:
        return int(self.prototypes.shape[1])

    @property
    def num_internal_nodes(self) -> int:
        return self._num_internal

    def route(
        self, x: torch.Tensor | np.ndarray, mode: Mode = "tree", top_k: int = 1
    ) -> Routing:
        """Route a batch x [B, n] (torch or numpy, float32/float64).

        top_k > 1 is always the exact k nearest prototypes, whatever the mode. Raises a
        RouterInputError subclass for a bad batch, mode or top_k.
        """
        return self._route(x, check_mode(mode), check_top_k(top_k, self.num_prototypes))

    def _route(self, x: torch.Tensor | np.ndarray, mode: Mode, k: int) -> Routing:
        """`route` for a checked mode and k. Each branch checks the rows once, in the
        precision it computes in: float64 for the scans, float32 for the walk (not float64
        and back)."""
        if k > 1:
            xs = to_inputs(x, self.dim)
            idx, d2 = self._blocked_search().knn(xs, k)
            evals = torch.full((xs.shape[0],), self.num_prototypes, dtype=torch.long)
            return Routing(
                experts=idx,
                weights=gate_weights(d2, self.temperature),
                distances=d2.sqrt().to(torch.float32),
                distance_evals=evals,
            )
        if mode == "exact" and self.num_internal_nodes > 0:
            xs = to_inputs(x, self.dim)
            if search_pays(self.num_prototypes, self.branching, self.depth):
                leaf, best, evals = exact_nearest(
                    xs, self._seeder(xs), self._exact_index(), self._blocked_search()
                )
                dist = best.sqrt().to(torch.float32)
            else:
                # Too few prototypes for the search to pay: scan them all, skipping the walk.
                idx, d2 = self._blocked_search().knn(xs, 1)
                leaf, dist = idx[:, 0], d2[:, 0].sqrt().to(torch.float32)
                evals = torch.full((xs.shape[0],), self.num_prototypes, dtype=torch.long)
        else:
            xs = to_inputs(x, self.dim, torch.float32)
            leaf, sq32, evals = greedy_walk(xs, self._walk)
            dist = sq32.sqrt()
        b = xs.shape[0]
        return Routing(
            experts=leaf[:, None],
            weights=torch.ones((b, 1), dtype=torch.float32),
            distances=dist[:, None],
            distance_evals=evals,
        )

    def gate(self, x: torch.Tensor | np.ndarray, gate: Gate) -> GateRouting:
        """Each row's experts and weights under `gate` (see `router.Gate`), row by row.

        A beam of width 1 at every level gives `route(x, mode="tree")`'s experts; top_k = 1
        without a beam gives `route(x, gate.mode)`'s. Raises RouterInputError subclasses
        (BadGate for a bad setting).
        """
        gate = check_gate(gate, self.num_prototypes)
        beam = gate.beam
        if beam is None and gate.top_k > 1 and gate.mode == "tree" and gate.tree_top_k == "beam":
            beam = (gate.top_k,)
        # Each branch checks the rows once, in the precision it computes in.
        if beam is not None:
            leaf, logw, sq, evals = beam_walk(
                to_inputs(x, self.dim, torch.float32), self._walk, beam, gate.temperature,
                gate.score,
            )
            # Renormalised over the leaves that survived the beam (exactly 1 with none cut).
            weights = torch.softmax(logw, dim=1).masked_fill(leaf < 0, 0.0)
            distances = sq.sqrt()
            experts = leaf
        elif gate.top_k == 1:
            r = self._route(x, gate.mode, 1)
            # One real expert per row at weight 1: sparsify would keep it whatever min_weight
            # and top_p say (a row keeps its heaviest expert) and divide 1 by 1, so its ~15
            # tensor ops per batch are skipped.
            weights = torch.ones((r.experts.shape[0], 1), dtype=torch.float64)
            return GateRouting(r.experts, weights, r.distances, r.distance_evals)
        else:
            xs = to_inputs(x, self.dim)
            b = xs.shape[0]
            experts, d2 = self._blocked_search().knn(xs, gate.top_k)
            s = d2.sqrt() if gate.score == "dist" else d2
            weights = torch.softmax(-s / gate.temperature, dim=1)
            distances = d2.sqrt().to(torch.float32)
            evals = torch.full((b,), self.num_prototypes, dtype=torch.long)
        experts, weights, distances = sparsify(experts, weights, distances, gate)
        return GateRouting(experts, weights, distances, evals)

    def with_temperature(self, temperature: float) -> PrototypeTree:
        """The same tree with another default temperature (the arrays are shared)."""
        return PrototypeTree(
            self.prototypes, self._arrays, self.branching, temperature, self.balanced
        )

    def save(self, path: Path | str) -> None:
        """Write the tree as safetensors (atomically; no pickle)."""
        write_router(
            path, self.prototypes, self._arrays, self.branching, self.temperature, self.balanced
        )

    @classmethod
    def load(cls, path: Path | str) -> PrototypeTree:
        """Read a tree written by save(); RouterFileError if missing or inconsistent."""
        prototypes, arrays, branching, temperature, balanced = read_router(path)
        return cls(prototypes, arrays, branching, temperature, balanced)

    def _seeder(self, xs: torch.Tensor) -> Seeder:
        """The greedy walk's answer for some rows of xs, as exact_nearest's starting point."""

        def seed(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x = xs[rows]
            leaf, _, evals = greedy_walk(x.to(torch.float32), self._walk)
            return leaf, sq_dist_rows(x, self.prototypes[leaf].to(torch.float64)), evals

        return seed

    def _blocked_search(self) -> BlockedSearch:
        if self._search is None:
            self._search = BlockedSearch(self.prototypes, dtype=torch.float32)
        return self._search

    def _exact_index(self) -> ExactIndex:
        if self._exact is None:
            self._exact = ExactIndex.from_walk(
                self._walk, self._arrays.radius, voronoi=not self.balanced
            )
        return self._exact

    def _node_points(self) -> torch.Tensor:
        """Internal points then prototypes: row num_internal + p is the leaf of p."""
        return torch.cat([self._arrays.points, self.prototypes], dim=0)

    def __repr__(self) -> str:
        return (
            f"PrototypeTree(num_prototypes={self.num_prototypes}, dim={self.dim}, "
            f"branching={self.branching}, depth={self.depth}, temperature={self.temperature}, "
            f"balanced={self.balanced})"
        )
