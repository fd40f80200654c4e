"""router.Gate through PrototypeTree.gate: the beam walk against the greedy walk and against
an independent float64 dense hierarchical mixture; dense-to-sparse pruning (router/_gate.py,
router/_beam.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from router import BadGate, Gate, PrototypeTree

pytestmark = pytest.mark.unit


def tree_of(k: int, nu: int, n: int, seed: int = 0) -> PrototypeTree:
    p = torch.rand(k, n, generator=torch.Generator().manual_seed(seed))
    return PrototypeTree.build(p, branching=nu, seed=seed)


def dense_hierarchical(path: Path, x: np.ndarray, tau: float, score: str) -> np.ndarray:
    """Leaf weights [B, K] in float64 from the router file alone: the product over the
    root-to-leaf path of softmax(-score/τ) over each node's children (seed 002, eq. 20)."""
    t = load_file(str(path))
    points, children, protos = t["internal_points"], t["children"], t["prototypes"]
    m = points.shape[0]
    nodes = np.concatenate([points, protos]).astype(np.float32)
    out = np.zeros((x.shape[0], protos.shape[0]))

    def visit(node: int, weight: np.ndarray) -> None:
        if node >= m:
            out[:, node - m] = weight
            return
        kids = [c for c in children[node].tolist() if c >= 0]
        d = ((nodes[kids][None, :, :] - x[:, None, :].astype(np.float32)) ** 2).sum(-1)
        s = d.astype(np.float64)
        s = np.sqrt(s) if score == "dist" else s
        z = -s / tau
        w = np.exp(z - z.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        for j, c in enumerate(kids):
            visit(c, weight * w[:, j])

    visit(0, np.ones(x.shape[0]))
    return out


@pytest.mark.parametrize("k,nu,n", [(16, 4, 2), (64, 4, 3), (37, 3, 2), (200, 5, 4)])
def test_a_beam_of_width_one_is_the_tree_walk(k: int, nu: int, n: int) -> None:
    tree = tree_of(k, nu, n)
    x = torch.rand(10_000, n, generator=torch.Generator().manual_seed(1)) * 1.2 - 0.1
    walk = tree.route(x, mode="tree")
    for tau in (1e-4, 1.0):
        g = tree.gate(x, Gate(beam=(1,) * tree.depth, temperature=tau))
        assert torch.equal(g.experts, walk.experts)
        assert torch.equal(g.weights, torch.ones_like(g.weights))
        assert torch.equal(g.distance_evals, walk.distance_evals)


@pytest.mark.parametrize("score", ["sqdist", "dist"])
def test_an_unpruned_beam_is_the_dense_hierarchical_mixture(tmp_path: Path, score: str) -> None:
    tree = tree_of(37, 3, 2, seed=4)
    tree.save(tmp_path / "r.safetensors")
    x = np.random.default_rng(2).uniform(-0.1, 1.1, size=(500, 2))
    wide = tuple(3 ** (level + 1) for level in range(tree.depth))
    for tau in (0.003, 0.05, 1.0):
        g = tree.gate(x, Gate(beam=wide, temperature=tau, score=score))  # type: ignore[arg-type]
        got = np.zeros((500, 37))
        np.put_along_axis(got, g.experts.numpy(), g.weights.numpy(), axis=1)
        want = dense_hierarchical(tmp_path / "r.safetensors", x, tau, score)
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    # ν·Σ beam bounds the distance evaluations of a pruned beam.
    g = tree.gate(x, Gate(beam=(2,), temperature=0.05))
    assert int(g.distance_evals.max()) <= 3 * 2 * tree.depth
    assert int(g.kept.max()) == 2


@pytest.mark.parametrize(
    "gate",
    [Gate(top_k=5, temperature=0.02, min_weight=0.1), Gate(top_k=5, temperature=0.02, top_p=0.8),
     Gate(beam=(3, 3), temperature=0.02, min_weight=0.05, top_p=0.9)],
)
def test_dense_to_sparse_keeps_a_prefix_summing_to_one(gate: Gate) -> None:
    tree = tree_of(64, 4, 2, seed=3)
    x = torch.rand(2_000, 2, generator=torch.Generator().manual_seed(9))
    full = tree.gate(x, Gate(top_k=gate.top_k, beam=gate.beam, temperature=gate.temperature))
    g = tree.gate(x, gate)
    kept = g.kept
    np.testing.assert_allclose(g.weights.sum(1).numpy(), 1.0, atol=1e-6)
    assert int(kept.min()) >= 1 and int(kept.max()) > int(kept.min())  # rows differ
    for i in range(0, 2_000, 97):
        n = int(kept[i])
        assert g.experts[i, :n].tolist() == full.experts[i, :n].tolist()
        w = full.weights[i]
        if gate.min_weight:
            assert bool((w[:n] >= gate.min_weight).all()) or n == 1
        if gate.top_p < 1.0:
            assert float(w[: n - 1].sum()) < gate.top_p
        ratio = g.weights[i, :n] / w[:n]
        torch.testing.assert_close(ratio, ratio[:1].expand(n))  # renormalised, not reshaped


def test_bad_gates_are_refused() -> None:
    tree = tree_of(16, 4, 2)
    x = torch.zeros(1, 2)
    for gate, field in [(Gate(top_k=17), "top_k"), (Gate(temperature=0.0), "temperature"),
                        (Gate(top_p=0.0), "top_p"), (Gate(min_weight=1.0), "min_weight"),
                        (Gate(top_k=2, beam=(2,)), "beam"), (Gate(beam=(0,)), "beam")]:
        with pytest.raises(BadGate) as info:
            tree.gate(x, gate)
        assert info.value.field == field
