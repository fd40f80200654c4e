"""Exact top-k of a lifted linear router by logit bounds (router/_linear_search.py): the same
answer, bit for bit, as the scan of `PrototypeTree.gate` on lifted rows, with fewer
evaluations on a clustered router."""

from __future__ import annotations

import pytest
import torch

from router import Gate, LinearGateRouter, PrototypeTree, lift_rows, linear_lift

pytestmark = pytest.mark.unit


def _voronoi(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits of a sqdist prototype gate on clustered points, and queries near them."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(k // 50, 8, generator=g, dtype=torch.float64)
    p = centres[torch.randint(0, len(centres), (k,), generator=g)]
    p = p + 0.02 * torch.randn(k, 8, generator=g, dtype=torch.float64)
    x = centres[torch.randint(0, len(centres), (600,), generator=g)]
    x = x + 0.02 * torch.randn(600, 8, generator=g, dtype=torch.float64)
    return (2 * p).float(), -(p * p).sum(dim=1).float(), x.float()


@pytest.mark.parametrize(("top_k", "score"), [(1, "sqdist"), (4, "sqdist"), (3, "dist")])
def test_search_equals_the_scan_bit_for_bit(top_k: int, score: str) -> None:
    w, b, x = _voronoi(4000, seed=top_k)
    tree = PrototypeTree.build(linear_lift(w, b), branching=4)
    gate = Gate(top_k=top_k, mode="exact", temperature=0.05, score=score)  # type: ignore[arg-type]
    searched = LinearGateRouter(tree, search="always").gate(x, gate)
    scanned = tree.gate(lift_rows(x), gate)
    assert torch.equal(searched.experts, scanned.experts)
    assert torch.equal(searched.weights, scanned.weights)
    assert torch.equal(searched.distances, scanned.distances)
    # The bounds prune: far fewer evaluations than the scan's K per query.
    assert float(searched.distance_evals.double().mean()) < 4000 / 2
    logits = x.double() @ w.double().T + b.double()
    assert torch.equal(searched.experts[:, 0], logits.argmax(dim=1))


def test_other_gates_and_ties_go_through_the_tree() -> None:
    w = torch.zeros(3000, 2)
    b = torch.zeros(3000)  # every logit tied: the lowest index wins, as in the scan
    tree = PrototypeTree.build(linear_lift(w, b), branching=4)
    router = LinearGateRouter(tree, search="always")
    x = torch.randn(5, 2)
    two = Gate(top_k=2, mode="exact")
    assert torch.equal(router.gate(x, two).experts, tree.gate(lift_rows(x), two).experts)
    walk = router.gate(x, Gate(top_k=1, mode="tree"))
    assert torch.equal(walk.experts, tree.gate(lift_rows(x), Gate(top_k=1, mode="tree")).experts)
    assert router.dim == 2 and router.num_prototypes == 3000
