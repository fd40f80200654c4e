"""Tree construction: every prototype one leaf, children are Voronoi cells, radii cover."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from router_testdata import make_prototypes

from router import PrototypeTree, RouterBuildError

pytestmark = pytest.mark.unit


def _leaves_below(children: np.ndarray, m: int, k: int) -> list[list[int]]:
    """Prototype indices under each internal node, computed bottom-up (ids grow downwards)."""
    below: list[list[int]] = [[] for _ in range(m)]
    for node in range(m - 1, -1, -1):
        for c in children[node]:
            if c < 0:
                continue
            below[node].extend([int(c) - m] if c >= m else below[c])
    return below


def check_tree(tree: PrototypeTree) -> None:
    children = tree._arrays.children.numpy()
    m, k = tree.num_internal_nodes, tree.num_prototypes
    nodes = tree._node_points().numpy().astype(np.float64)
    radius = tree._arrays.radius.numpy()
    assert children.shape == (m, tree.branching)
    if m == 0:
        assert k == 1
        return
    below = _leaves_below(children, m, k)
    assert sorted(below[0]) == list(range(k))
    protos = tree.prototypes.numpy().astype(np.float64)
    for node in range(m):
        kids = [int(c) for c in children[node] if c >= 0]
        assert len(kids) >= 2 or k == 1
        d_cover = np.sqrt(((protos[below[node]] - nodes[node]) ** 2).sum(axis=1))
        assert d_cover.max() <= radius[node] * (1 + 1e-12) + 1e-12
        centres = nodes[kids]
        for slot, c in enumerate(kids):
            members = [c - m] if c >= m else below[c]
            d2 = ((protos[members][:, None, :] - centres[None]) ** 2).sum(axis=2)
            # Each child's leaves lie in that child's Voronoi cell among its siblings.
            assert (d2[:, slot] <= d2.min(axis=1)).all()


@pytest.mark.parametrize("kind", ["uniform", "clustered", "lowdim", "duplicates"])
@pytest.mark.parametrize("nu", [2, 4, 7])
def test_structure_on_each_kind_of_data(kind: str, nu: int) -> None:
    p = make_prototypes(kind, 600, 4, np.random.default_rng(nu))
    tree = PrototypeTree.build(p, branching=nu, seed=1)
    check_tree(tree)


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 80),
    n=st.integers(1, 5),
    nu=st.integers(2, 6),
    kind=st.sampled_from(["uniform", "clustered", "lowdim", "duplicates"]),
    seed=st.integers(0, 2**16),
)
def test_structure_property(k: int, n: int, nu: int, kind: str, seed: int) -> None:
    p = make_prototypes(kind, k, n, np.random.default_rng(seed))
    check_tree(PrototypeTree.build(p, branching=nu, seed=seed))


def test_all_identical_prototypes() -> None:
    tree = PrototypeTree.build(torch.ones(50, 3), branching=4)
    check_tree(tree)
    r = tree.route(torch.ones(2, 3))
    assert r.experts[:, 0].tolist() == [0, 0]
    assert tree.route(torch.zeros(1, 3), mode="exact").experts.item() == 0


def test_wide_inputs_build() -> None:
    p = make_prototypes("clustered", 300, 768, np.random.default_rng(0))
    tree = PrototypeTree.build(p, branching=8, seed=0)
    check_tree(tree)
    assert tree.dim == 768


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"branching": 1}, "branching"),
        ({"branching": 2.5}, "branching"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(RouterBuildError, match=match):
        PrototypeTree.build(torch.rand(10, 2), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "protos",
    [torch.rand(0, 3), torch.rand(5), torch.rand(4, 0), torch.tensor([[0.0, float("nan")]])],
)
def test_bad_prototypes_are_refused(protos: torch.Tensor) -> None:
    with pytest.raises(RouterBuildError):
        PrototypeTree.build(protos)
