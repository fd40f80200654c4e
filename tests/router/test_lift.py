"""The linear lift (router/_lift.py): a linear softmax router served exactly as the sqdist
prototype gate on lifted points."""

from __future__ import annotations

import pytest
import torch

from router import (
    Gate,
    PrototypeTree,
    lift_rows,
    lifted_temperature,
    linear_lift,
    linear_logits,
    unlift,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("scale", "tau"), [(1.0, 1.0), (20.0, 0.05)])
def test_exact_gate_on_lifted_rows_is_the_softmax_of_the_logits(scale: float, tau: float) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 5, generator=g) * scale
    b = torch.randn(64, generator=g) * scale
    tree = PrototypeTree.build(linear_lift(w, b), branching=4)
    x = torch.rand(2000, 5, generator=g) * 4 - 2
    logits = x.double() @ w.double().T + b.double()
    want = torch.softmax(logits / tau, dim=1)
    # Large M against a small τ (scale 20: M ≈ 4e3, τ 0.05): still exact to float64 rounding.
    routed = tree.gate(lift_rows(x), Gate(top_k=8, mode="exact",
                                          temperature=lifted_temperature(tau)))
    top = torch.topk(logits, 8, dim=1)
    assert torch.equal(routed.experts, top.indices)
    kept = torch.softmax(top.values / tau, dim=1)
    torch.testing.assert_close(routed.weights, kept, rtol=0, atol=1e-9)
    full = tree.gate(lift_rows(x), Gate(top_k=64, mode="exact",
                                        temperature=lifted_temperature(tau)))
    got = torch.zeros_like(want).scatter_(1, full.experts, full.weights)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    one = tree.gate(lift_rows(x), Gate(top_k=1, mode="exact"))
    assert torch.equal(one.experts[:, 0], logits.argmax(dim=1))


def test_the_lift_keeps_the_router_and_one_norm() -> None:
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(16, 3, generator=g), torch.randn(16, generator=g)
    lifted = linear_lift(w, b)
    assert lifted.dtype == torch.float32 and lifted.shape == (16, 3 + 3)
    w2, b2 = unlift(lifted)
    assert torch.equal(w2, w) and torch.equal(b2, b)
    norms = (lifted.double() ** 2).sum(dim=1)
    assert float(norms.max() - norms.min()) <= 1e-13 * float(norms.max())
    x = torch.randn(10, 3, generator=g)
    torch.testing.assert_close(linear_logits(lifted, x), x.double() @ w.double().T + b.double())
