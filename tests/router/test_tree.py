"""PrototypeTree.build + route(): the tree walk, exact mode and top-k through the public API."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from router_testdata import make_prototypes, make_queries, numpy_knn

from router import PrototypeTree

pytestmark = pytest.mark.unit


def _algorithm_1(x: float) -> int:
    """Algorithm 1 of the paper with its leaf indices fixed to the intended 0..3."""
    if abs(x - 1 / 4) < abs(x - 3 / 4):
        return 0 if abs(x - 1 / 8) < abs(x - 3 / 8) else 1
    return 2 if abs(x - 5 / 8) < abs(x - 7 / 8) else 3


def test_example_1_routes_like_algorithm_1() -> None:
    tree = PrototypeTree.build(torch.tensor([[1 / 8], [3 / 8], [5 / 8], [7 / 8]]), branching=2)
    # The first query of Algorithm 1 compares against 1/4 and 3/4: the tree's inner points.
    inner = sorted(float(v) for v in tree._node_points()[1:3, 0])
    assert inner == [0.25, 0.75]
    ties = {0.25, 0.5, 0.75}
    xs = [i / 64 for i in range(65) if i / 64 not in ties]
    r = tree.route(torch.tensor(xs)[:, None])
    assert r.experts[:, 0].tolist() == [_algorithm_1(x) for x in xs]
    assert r.distance_evals.tolist() == [4] * len(xs)  # nu * L = 2 * 2
    # Exactly on a boundary both leaves are nearest; ties go to the lowest index.
    tie = tree.route(torch.tensor([[0.25], [0.5], [0.75]]))
    assert tie.experts[:, 0].tolist() == [0, 1, 2]


def _hierarchical(nu: int, levels: int, n: int) -> torch.Tensor:
    """nu^levels points whose clusters nest with a 10x gap per level: k-means splits evenly."""
    rng = np.random.default_rng(0)
    offsets = [rng.standard_normal((nu, n)) * 10.0 ** (levels - lvl) for lvl in range(levels)]
    pts = np.zeros((1, n))
    for off in offsets:
        pts = (pts[:, None, :] + off[None, :, :]).reshape(-1, n)
    return torch.tensor(pts, dtype=torch.float32)


@pytest.mark.parametrize(("nu", "levels"), [(2, 5), (3, 3), (4, 3), (8, 2)])
def test_balanced_tree_costs_exactly_nu_times_levels(nu: int, levels: int) -> None:
    protos = _hierarchical(nu, levels, n=3)
    tree = PrototypeTree.build(protos, branching=nu, seed=3)
    assert tree.depth == levels
    x = protos + 0.01 * torch.randn(protos.shape, generator=torch.Generator().manual_seed(1))
    r = tree.route(x)
    assert r.distance_evals.tolist() == [nu * levels] * len(x)
    assert math.ceil(math.log(len(protos), nu) - 1e-9) == levels
    # Well-separated clusters: the greedy walk finds the true nearest prototype.
    assert r.experts[:, 0].tolist() == list(range(len(protos)))


@pytest.mark.parametrize("kind", ["uniform", "clustered", "lowdim", "duplicates"])
def test_tree_walk_reports_true_distances_and_bounded_cost(kind: str) -> None:
    rng = np.random.default_rng(7)
    p = make_prototypes(kind, 700, 5, rng)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = make_queries(p, 200, rng)
    r = tree.route(x)
    assert r.experts.shape == (600, 1) and r.experts.dtype == torch.long
    chosen = p[r.experts[:, 0].numpy()].astype(np.float64)
    want = np.sqrt(((x.astype(np.float32).astype(np.float64) - chosen) ** 2).sum(axis=1))
    np.testing.assert_allclose(r.distances[:, 0].numpy(), want, rtol=1e-5, atol=1e-6)
    assert int(r.distance_evals.max()) <= 4 * tree.depth
    assert torch.equal(r.weights, torch.ones(600, 1))


def test_tree_walk_sends_each_prototype_to_itself_or_its_lowest_duplicate() -> None:
    rng = np.random.default_rng(2)
    p = make_prototypes("duplicates", 400, 3, rng)
    tree = PrototypeTree.build(p, branching=3, seed=5)
    r = tree.route(p)
    first_copy = numpy_knn(p, p)[0][:, 0]
    assert r.experts[:, 0].tolist() == first_copy.tolist()


def test_same_seed_same_tree_and_routes() -> None:
    rng = np.random.default_rng(4)
    p = make_prototypes("clustered", 3000, 6, rng)
    x = make_queries(p, 300, rng)
    a = PrototypeTree.build(p, branching=5, seed=11)
    b = PrototypeTree.build(p, branching=5, seed=11)
    assert torch.equal(a._arrays.children, b._arrays.children)
    assert torch.equal(a._arrays.points, b._arrays.points)
    assert torch.equal(a.route(x).experts, b.route(x).experts)


def test_single_prototype_costs_nothing() -> None:
    tree = PrototypeTree.build(torch.tensor([[1.0, 2.0]]), branching=4)
    assert tree.depth == 0
    for mode in ("tree", "exact"):
        r = tree.route(torch.tensor([[1.0, 2.0], [4.0, 6.0]]), mode=mode)
        assert r.experts.tolist() == [[0], [0]]
        assert r.distance_evals.tolist() == [0, 0]
        assert r.distances[:, 0].tolist() == [0.0, 5.0]


@pytest.mark.parametrize("kind", ["uniform", "clustered", "lowdim", "duplicates"])
def test_exact_mode_matches_float64_brute_force(kind: str) -> None:
    # K above the scan threshold, so the branch-and-bound path answers most queries.
    rng = np.random.default_rng(9)
    p = make_prototypes(kind, 5000, 3, rng)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = make_queries(p, 400, rng)
    r = tree.route(x, mode="exact")
    want_idx, want_d2 = numpy_knn(x, p)
    assert r.experts[:, 0].tolist() == want_idx[:, 0].tolist()
    np.testing.assert_allclose(r.distances[:, 0].numpy(), np.sqrt(want_d2[:, 0]), rtol=1e-6)
    assert int(r.distance_evals.min()) > 0


def test_exact_accepts_float32_and_float64_numpy_and_torch() -> None:
    rng = np.random.default_rng(1)
    p = make_prototypes("uniform", 300, 4, rng)
    tree = PrototypeTree.build(p, branching=3, seed=0)
    x64 = make_queries(p, 50, rng)
    x32 = x64.astype(np.float32)
    want64 = numpy_knn(x64, p)[0]
    want32 = numpy_knn(x32.astype(np.float64), p)[0]
    assert tree.route(x64, mode="exact").experts.numpy().tolist() == want64.tolist()
    assert tree.route(torch.from_numpy(x64), mode="exact").experts.numpy().tolist() == (
        want64.tolist()
    )
    assert tree.route(x32, mode="exact").experts.numpy().tolist() == want32.tolist()
    # The walk depends only on float32(x): float64 and float32 copies route alike.
    assert torch.equal(tree.route(x64).experts, tree.route(x32).experts)


@pytest.mark.parametrize("temperature", [0.05, 1.0, 30.0])
def test_top_k_is_exact_with_softmax_weights(temperature: float) -> None:
    rng = np.random.default_rng(3)
    p = make_prototypes("duplicates", 500, 3, rng)
    tree = PrototypeTree.build(p, branching=4, seed=0, temperature=temperature)
    x = make_queries(p, 60, rng)
    for mode in ("tree", "exact"):
        r = tree.route(x, mode=mode, top_k=5)
        want_idx, want_d2 = numpy_knn(x, p, k=5)
        assert r.experts.numpy().tolist() == want_idx.tolist()
        logits = -want_d2 / temperature
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(r.weights.numpy(), w, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(r.weights.sum(dim=1).numpy(), 1.0, rtol=1e-6)
        np.testing.assert_allclose(r.distances.numpy(), np.sqrt(want_d2), rtol=1e-6, atol=1e-7)


def test_top_1_weights_are_one_and_top_k_1_equals_exact() -> None:
    rng = np.random.default_rng(8)
    p = make_prototypes("clustered", 2500, 4, rng)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = make_queries(p, 100, rng)
    exact = tree.route(x, mode="exact", top_k=1)
    assert torch.equal(exact.weights, torch.ones(300, 1))
    full = tree.route(x, mode="exact", top_k=len(p))
    assert torch.equal(full.experts[:, :1], exact.experts)
    np.testing.assert_allclose(full.weights.sum(dim=1).numpy(), 1.0, rtol=1e-5)
