"""Branch-and-bound exact search: 100% agreement with a float64 numpy scan, ties included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from router_testdata import duplicate_each, make_prototypes, make_queries, numpy_knn

from router import PrototypeTree, Routing
from router._exact import exact_nearest

pytestmark = pytest.mark.unit

KINDS = ["uniform", "clustered", "lowdim", "duplicates"]


def _exact(
    tree: PrototypeTree, x: np.ndarray, switch_fraction: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the search with the scan threshold off so small trees exercise the bounds."""
    xs = torch.from_numpy(np.asarray(x, dtype=np.float64))
    idx, d2, evals = exact_nearest(
        xs,
        tree._seeder(xs),
        tree._exact_index(),
        tree._blocked_search(),
        min_tree_search=0,
        switch_fraction=switch_fraction,
    )
    return idx.numpy(), d2.numpy(), evals.numpy()


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 150),
    n=st.integers(1, 6),
    nu=st.integers(2, 6),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
    switch_fraction=st.sampled_from([0.0, 2.0, 8.0]),
)
def test_branch_and_bound_agrees_with_float64_scan(
    k: int, n: int, nu: int, kind: str, seed: int, switch_fraction: float
) -> None:
    rng = np.random.default_rng(seed)
    p = make_prototypes(kind, k, n, rng)
    tree = PrototypeTree.build(p, branching=nu, seed=seed)
    x = make_queries(p, 20, rng)
    idx, d2, evals = _exact(tree, x, switch_fraction)
    want_idx, want_d2 = numpy_knn(x, p)
    assert idx.tolist() == want_idx[:, 0].tolist()
    np.testing.assert_allclose(d2, want_d2[:, 0], rtol=1e-12, atol=0)
    assert (evals >= 0).all()


def test_near_ties_are_resolved_like_the_scan() -> None:
    # Pairs of prototypes one float32 ulp apart, queries on and beside their bisectors.
    rng = np.random.default_rng(5)
    base = rng.random((200, 3)).astype(np.float32)
    twin = np.nextafter(base, np.float32(2.0))
    p = np.concatenate([base, twin, base])  # exact duplicates too
    tree = PrototypeTree.build(p, branching=3, seed=0)
    mid = (base.astype(np.float64) + twin.astype(np.float64)) / 2
    x = np.concatenate([mid, np.nextafter(mid, 0.0), np.nextafter(mid, 2.0)])
    want_idx, _ = numpy_knn(x, p)
    idx, _, _ = _exact(tree, x, switch_fraction=0.0)
    assert idx.tolist() == want_idx[:, 0].tolist()
    assert tree.route(x, mode="exact").experts[:, 0].tolist() == want_idx[:, 0].tolist()


def test_pruning_pays_on_clustered_low_dimensional_data() -> None:
    rng = np.random.default_rng(0)
    p = make_prototypes("clustered", 4000, 2, rng)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = make_queries(p, 100, rng)
    idx, _, evals = _exact(tree, x, switch_fraction=0.0)
    assert idx.tolist() == numpy_knn(x, p)[0][:, 0].tolist()
    assert np.median(evals) < len(p) / 10


def _exact_on_uniform(k: int, b: int, seed: int) -> tuple[np.ndarray, PrototypeTree, Routing]:
    """Exact routes of b uniform queries over k uniform prototypes in 64-D, checked."""
    rng = np.random.default_rng(seed)
    p = make_prototypes("uniform", k, 64, rng)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = rng.random((b, 64))
    r = tree.route(x, mode="exact")
    assert r.experts[:, 0].tolist() == numpy_knn(x, p)[0][:, 0].tolist()
    return p, tree, r


def test_high_dimension_switches_to_the_scan() -> None:
    p, tree, r = _exact_on_uniform(3000, 50, seed=0)
    # A query that gave up on the tree paid for a full scan on top of its partial search.
    assert int(r.distance_evals.max()) >= len(p)
    assert int(r.distance_evals.max()) <= len(p) + len(p) // 8 + 4 * tree.depth + 4 * 8


def test_a_pilot_that_chooses_the_scan_spares_the_other_queries_the_walk() -> None:
    p, _, r = _exact_on_uniform(8000, 400, seed=2)
    # The pilot (16 queries here) walked and searched before scanning; the rest only scan.
    evals = r.distance_evals
    assert int((evals > len(p)).sum()) == 16
    assert int((evals == len(p)).sum()) == 400 - 16


@pytest.mark.parametrize("kind", KINDS)
def test_far_from_origin_data(kind: str) -> None:
    # Large offsets make the matmul expansion cancel badly; direct differences must decide.
    rng = np.random.default_rng(1)
    p = (make_prototypes(kind, 2600, 3, rng).astype(np.float64) * 1e-3 + 1e4).astype(np.float32)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = make_queries(p, 100, rng)
    want = numpy_knn(x, p)[0][:, 0].tolist()
    assert tree.route(x, mode="exact").experts[:, 0].tolist() == want
    idx, _, _ = _exact(tree, x, switch_fraction=0.0)
    assert idx.tolist() == want


def test_public_exact_mode_searches_the_tree_when_it_pays() -> None:
    rng = np.random.default_rng(3)
    p = make_prototypes("clustered", 12000, 2, rng)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = p[rng.integers(0, len(p), 600)] + 0.01 * rng.standard_normal((600, 2))
    r = tree.route(x, mode="exact")
    assert r.experts[:, 0].tolist() == numpy_knn(x, p)[0][:, 0].tolist()
    # Most queries were answered by the search, far below a scan of all K.
    assert float(np.median(r.distance_evals.numpy())) < len(p) / 20


def _small_store(kind: str, n: int, duplicated: bool, seed: int) -> np.ndarray:
    """K = 1,000 prototypes; duplicated: 500 distinct ones, each present twice."""
    rng = np.random.default_rng(seed)
    if duplicated:
        return duplicate_each(make_prototypes(kind, 500, n, rng), rng)
    return make_prototypes(kind, 1000, n, rng)


@pytest.mark.parametrize("duplicated", [False, True])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind", ["uniform", "clustered"])
def test_small_store_in_low_dimension_agrees_on_both_paths(
    kind: str, n: int, duplicated: bool
) -> None:
    # K = 1,000 is below the search threshold: public exact mode scans (K evaluations per
    # query); the branch-and-bound, forced on the same store, must give the same answers.
    # Queries include the prototypes themselves: with copies, exact ties to the lower index.
    p = _small_store(kind, n, duplicated, seed=n)
    rng = np.random.default_rng(n + 100)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = make_queries(p, 200, rng)
    want_idx, want_d2 = numpy_knn(x, p)
    r = tree.route(x, mode="exact")
    assert r.experts[:, 0].tolist() == want_idx[:, 0].tolist()
    assert r.distance_evals.tolist() == [len(p)] * len(x)
    np.testing.assert_allclose(
        r.distances[:, 0].numpy(), np.sqrt(want_d2[:, 0]).astype(np.float32), rtol=1e-6
    )
    idx, d2, evals = _exact(tree, x, switch_fraction=0.0)
    assert idx.tolist() == want_idx[:, 0].tolist()
    np.testing.assert_allclose(d2, want_d2[:, 0], rtol=1e-12, atol=0)
    assert float(np.median(evals)) < len(p)  # answered by the search, not a scan
    if duplicated:
        # The answer is always the first of its two copies.
        first = {tuple(row): i for i, row in reversed(list(enumerate(p.tolist())))}
        assert all(first[tuple(p[i].tolist())] == i for i in idx.tolist())


@pytest.mark.parametrize("kind", ["uniform", "clustered"])
def test_duplicated_store_searched_by_the_public_exact_mode(kind: str) -> None:
    # Large enough for the tree search to pay (K = 10,000, the benchmark's size; at 6,000
    # the pilot already finds a scan cheaper), every prototype twice: pruning must keep
    # the lower-index copy of each tied pair.
    rng = np.random.default_rng(7)
    p = duplicate_each(make_prototypes(kind, 5000, 2, rng), rng)
    tree = PrototypeTree.build(p, branching=4, seed=0)
    x = make_queries(p, 100, rng)
    r = tree.route(x, mode="exact")
    assert r.experts[:, 0].tolist() == numpy_knn(x, p)[0][:, 0].tolist()
    assert float(np.median(r.distance_evals.numpy())) < len(p) / 10
