"""Balanced trees (`PrototypeTree.build(..., balanced=True)`): depth exactly ⌈log_ν K⌉, a
greedy walk costs at most ν⌈log_ν K⌉ evaluations per row, exact mode stays exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from router_testdata import make_prototypes, numpy_knn
from test_build import _leaves_below

from router import PrototypeTree

pytestmark = pytest.mark.unit


def _ceil_log(k: int, nu: int) -> int:
    depth, reach = 0, 1
    while reach < k:
        reach, depth = reach * nu, depth + 1
    return depth


@pytest.mark.parametrize("kind", ["uniform", "clustered", "duplicates"])
@pytest.mark.parametrize(
    ("k", "nu"), [(2, 2), (5, 4), (16, 4), (17, 4), (64, 4), (100, 3), (300, 7)]
)
def test_depth_is_ceil_log_and_a_walk_costs_at_most_nu_per_level(
    kind: str, k: int, nu: int
) -> None:
    rng = np.random.default_rng(k * 10 + nu)
    p = make_prototypes(kind, k, 3, rng)
    tree = PrototypeTree.build(p, branching=nu, seed=0, balanced=True)
    assert tree.depth == _ceil_log(k, nu)
    children = tree._arrays.children.numpy()
    m = tree.num_internal_nodes
    below = _leaves_below(children, m, k)
    assert sorted(below[0]) == list(range(k))  # every prototype is exactly one leaf
    for node in range(m):
        kids = [int(c) for c in children[node] if c >= 0]
        sizes = [1 if c >= m else len(below[c]) for c in kids]
        # Capacity-constrained split: no child holds more than ⌈m/ν⌉ of its parent's leaves.
        assert max(sizes) <= max(1, -(-len(below[node]) // nu))
        points = tree._node_points().numpy().astype(np.float64)
        cover = np.sqrt(((p[below[node]].astype(np.float64) - points[node]) ** 2).sum(axis=1))
        assert cover.max() <= tree._arrays.radius[node].item() * (1 + 1e-12) + 1e-12
    x = rng.standard_normal((400, 3)).astype(np.float32)
    routed = tree.route(x, mode="tree")
    assert int(routed.distance_evals.max()) <= nu * _ceil_log(k, nu)


def test_the_default_tree_can_exceed_the_bound_that_the_balanced_one_keeps() -> None:
    # K = 16, ν = 4: the k-means tree goes 3 levels deep here, the balanced one 2.
    p = make_prototypes("clustered", 16, 2, np.random.default_rng(3))
    default = PrototypeTree.build(p, branching=4, seed=0)
    balanced = PrototypeTree.build(p, branching=4, seed=0, balanced=True)
    assert balanced.depth == 2
    assert default.depth >= balanced.depth
    x = np.random.default_rng(4).standard_normal((500, 2)).astype(np.float32)
    assert int(balanced.route(x).distance_evals.max()) <= 8


def test_exact_mode_on_a_balanced_tree_is_the_nearest_prototype(tmp_path: Path) -> None:
    # K above the scan threshold, so exact mode runs the tree search (ball bound only).
    rng = np.random.default_rng(0)
    p = make_prototypes("uniform", 5000, 2, rng)
    tree = PrototypeTree.build(p, branching=4, seed=0, balanced=True)
    x = rng.random((300, 2)).astype(np.float32)
    want, _ = numpy_knn(x, p, 1)
    exact = tree.route(x, mode="exact")
    assert (exact.experts.numpy()[:, 0] == want[:, 0]).all()
    assert int(exact.distance_evals.max()) > 5000  # the tree search ran (then the scan)
    # The flag survives the file, and a default tree's file does not carry it.
    tree.save(tmp_path / "b.safetensors")
    loaded = PrototypeTree.load(tmp_path / "b.safetensors")
    assert loaded.balanced and loaded.depth == tree.depth
    assert torch.equal(loaded.route(x).experts, tree.route(x).experts)
    PrototypeTree.build(p[:50], branching=4, seed=0).save(tmp_path / "d.safetensors")
    assert not PrototypeTree.load(tmp_path / "d.safetensors").balanced


def test_balanced_build_is_deterministic_for_a_seed() -> None:
    p = make_prototypes("uniform", 200, 3, np.random.default_rng(1))
    a = PrototypeTree.build(p, branching=4, seed=5, balanced=True)
    b = PrototypeTree.build(p, branching=4, seed=5, balanced=True)
    assert torch.equal(a._arrays.children, b._arrays.children)
    assert torch.equal(a._arrays.points, b._arrays.points)


def test_momlp_build_balanced_tree_option_writes_a_balanced_router(tmp_path: Path) -> None:
    from experts_store import Store
    from server._cli import main

    out = tmp_path / "store"
    code = main([
        "build", "--dataset", "ackley2d", "--executor", "local", "--experts", "16",
        "--branching", "4", "--grid-size", "12", "--width", "8", "--epochs", "1",
        "--prototype-epochs", "1", "--no-baseline", "--balanced-tree", "--out", str(out),
        "--no-progress",
    ])
    assert code == 0
    store = Store.open(out)
    tree = PrototypeTree.load(store.router_path)
    assert tree.balanced and tree.depth == 2
    x = np.random.default_rng(0).uniform(-1, 1, (300, 2)).astype(np.float32)
    assert int(tree.route(x).distance_evals.max()) <= 8
    report = store.report()
    assert report is not None and report["config"]["balanced_tree"] is True
    assert main(["store", "verify", str(out)]) == 0
