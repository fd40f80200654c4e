"""The batched walk against a one-input-at-a-time walk written from the definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from router_testdata import make_prototypes

from router import PrototypeTree
from router._walk import greedy_walk

pytestmark = pytest.mark.unit


def slow_walk(tree: PrototypeTree, x: np.ndarray) -> tuple[list[int], list[int]]:
    """At each node, measure every child and go to the nearest, ties to the lowest slot.

    A distance is torch's float32 sum of squared differences, the walk's definition. numpy
    sums 33 floats in another order, and two children one ulp apart can swap: for k=127,
    n=33, ν=5, seed 7244, duplicated, numpy gives two of the root's grandchildren 24.5867386
    and 24.5867405, torch the reverse.
    """
    children = tree._arrays.children.numpy()
    nodes = tree._node_points()
    m = tree.num_internal_nodes
    experts, costs = [], []
    for row in torch.from_numpy(x.astype(np.float32)):
        node, cost = 0, 0
        while node < m:
            kids = [int(c) for c in children[node] if c >= 0]
            d = [float(((nodes[c] - row) ** 2).sum()) for c in kids]
            cost += len(kids)
            node = kids[int(np.argmin(d))]
        experts.append(node - m if m else 0)
        costs.append(cost)
    return experts, costs


@settings(max_examples=30, deadline=None)
@given(
    k=st.integers(1, 120),
    n=st.integers(1, 4),
    nu=st.integers(2, 5),
    seed=st.integers(0, 2**16),
    integer_grid=st.booleans(),
)
def test_batched_walk_equals_the_definition(
    k: int, n: int, nu: int, seed: int, integer_grid: bool
) -> None:
    rng = np.random.default_rng(seed)
    if integer_grid:
        # Small integers: float32 arithmetic is exact, so exact ties are frequent.
        p = rng.integers(0, 4, (k, n)).astype(np.float32)
        x = rng.integers(-1, 5, (40, n)).astype(np.float64)
    else:
        p = make_prototypes("clustered", k, n, rng)
        x = rng.random((40, n))
    tree = PrototypeTree.build(p, branching=nu, seed=seed)
    r = tree.route(x)
    experts, costs = slow_walk(tree, x)
    assert r.experts[:, 0].tolist() == experts
    assert r.distance_evals.tolist() == costs


@settings(max_examples=30, deadline=None)
@given(
    k=st.integers(1, 150),
    n=st.sampled_from([1, 2, 3, 7, 16, 17, 33]),
    nu=st.integers(2, 8),
    seed=st.integers(0, 2**16),
    duplicated=st.booleans(),
)
# A near-tie that numpy's summation order once broke the other way (see slow_walk).
@example(k=127, n=33, nu=5, seed=7244, duplicated=True)
def test_walk_distance_is_the_float32_distance_to_its_leaf(
    k: int, n: int, nu: int, seed: int, duplicated: bool
) -> None:
    """Every row takes the deepest leaf's number of steps (a leaf steps onto itself): the
    distance it returns is still the one float32 sum of squared differences to its leaf."""
    rng = np.random.default_rng(seed)
    p = make_prototypes("clustered", k, n, rng).astype(np.float32)
    if duplicated:
        p = np.concatenate([p, p])
    tree = PrototypeTree.build(p, branching=nu, seed=seed)
    x = torch.from_numpy((rng.random((50, n)) * 3 - 1).astype(np.float32))
    leaf, sq, evals = greedy_walk(x, tree._walk)
    experts, costs = slow_walk(tree, x.numpy())
    assert leaf.tolist() == experts
    assert evals.tolist() == costs
    prototypes = torch.from_numpy(p)
    for row, expert, got in zip(x, experts, sq, strict=True):
        diff = prototypes[expert] - row
        assert torch.equal((diff * diff).sum(), got)
