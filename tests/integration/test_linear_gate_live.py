"""A learned linear gate (`momlp build --gate learned-linear`) served by the real server
(uvicorn on loopback, Ray actors) through the prototype tree by the linear lift."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from live_support import serve_app

from experts_store import Store, load_frozen_expert
from router import PrototypeTree, linear_logits, unlift
from server._cli import main

pytestmark = [pytest.mark.integration, pytest.mark.ray]

K = 8


@pytest.fixture(scope="module")
def linear_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("linear") / "store"
    argv = [
        "build", "--dataset", "ackley2d", "--quick", "--grid-size", "24", "--experts", str(K),
        "--branching", "4", "--routing", "exact", "--gate", "learned-linear",
        "--gate-temperature-schedule", "1:0.25", "--expert-activation", "gelu",
        "--executor", "local", "--no-baseline", "--no-progress", "--out", str(out),
    ]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def live_url(ray_session: None, linear_store: Path) -> Iterator[str]:
    from server import Settings, create_app

    settings = Settings(store=linear_store, port=0, actors=2, cache_bytes=1 << 22,
                        watch_store=False, max_rows=512)
    with serve_app(create_app(settings), name="momlp-uvicorn-linear") as url:
        yield url


def _router(store: Path) -> tuple[torch.Tensor, float]:
    """The stored router's lifted prototypes and its τ (of softmax(logits / τ))."""
    s = Store.open(store)
    return PrototypeTree.load(s.router_path).prototypes, s.manifest.gate_spec.temperature / 2


def test_the_store_records_the_lift_and_its_activation(linear_store: Path) -> None:
    s = Store.open(linear_store)
    gate = s.manifest.gate_spec
    assert gate.lift == "linear" and gate.temperature == pytest.approx(2 * 0.25)
    assert gate.calibration is not None and gate.calibration["schedule"] == [1.0, 0.25]
    assert "approximation" in gate.calibration["tree_mode"]
    assert {e.arch.get("activation") for e in s.manifest.experts} == {"gelu"}
    assert s.manifest.input_dim == 2
    assert PrototypeTree.load(s.router_path).dim == 2 + 3


def test_store_verify_passes_a_linear_gates_lifted_router(
    linear_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its router rows have input_dim + 3 coordinates, which verify took for a wrong dimension.
    from experts_store import LINEAR_LIFT_EXTRA_DIMS
    from router._lift import LIFT_EXTRA_DIMS

    assert LINEAR_LIFT_EXTRA_DIMS == LIFT_EXTRA_DIMS
    assert Store.open(linear_store).verify() == []
    assert main(["store", "verify", str(linear_store), "--no-progress"]) == 0, capsys.readouterr()


def test_store_info_labels_tree_mode_an_approximation(
    linear_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["store", "info", str(linear_store)]) == 0
    text = capsys.readouterr().out
    assert "learned linear router" in text and "APPROXIMATION" in text


def test_served_exact_weights_are_the_softmax_of_the_linear_logits(
    linear_store: Path, live_url: str
) -> None:
    prototypes, tau = _router(linear_store)
    x = np.random.default_rng(7).uniform(-1, 1, size=(300, 2)).astype(np.float32)
    logits = linear_logits(prototypes, torch.as_tensor(x))
    want = torch.softmax(logits / tau, dim=1).numpy()
    with httpx.Client(base_url=live_url, timeout=120) as http:
        model = http.get("/v1/model").json()
        routed = http.post("/v1/route", json={"inputs": x.tolist(), "top_k": K, "mode": "exact"})
        top1 = http.post("/v1/route", json={"inputs": x.tolist(), "mode": "exact"})
        predicted = http.post(
            "/v1/predict", json={"inputs": x.tolist(), "top_k": K, "mode": "exact"}
        )
    # The store's input dimension, not the router's lifted one.
    assert model["input_dim"] == 2 and model["gate"]["lift"] == "linear"
    assert routed.status_code == top1.status_code == predicted.status_code == 200, routed.text
    experts = np.array(routed.json()["experts"])
    weights = np.array(routed.json()["weights"])
    got = np.zeros_like(want)
    np.put_along_axis(got, experts, weights, axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # Top-1 exact routing is the argmax of the logits.
    assert [e for (e,) in top1.json()["experts"]] == logits.argmax(dim=1).tolist()
    # Outputs: the softmax-weighted sum of the experts' own forwards, offline.
    s = Store.open(linear_store)
    outputs = np.zeros((len(x), 1), dtype=np.float64)
    for e in range(K):
        expert = load_frozen_expert(s.root / s.manifest.experts[e].file)
        with torch.inference_mode():
            y = np.stack([expert(torch.as_tensor(row[None]))[0].numpy() for row in x])
        outputs += want[:, e : e + 1] * y
    np.testing.assert_allclose(np.array(predicted.json()["outputs"]), outputs,
                               rtol=1e-6, atol=1e-6)


def test_the_router_is_the_unlifted_prototypes(linear_store: Path) -> None:
    prototypes, _ = _router(linear_store)
    w, b = unlift(prototypes)
    lifted = prototypes.double()
    # ‖w̃ᵢ‖² is the same M for every expert (to float64 rounding): the lift is exact.
    norms = (lifted * lifted).sum(dim=1)
    assert float(norms.max() - norms.min()) <= 1e-12 * float(norms.max())
    assert w.shape == (K, 2) and b.shape == (K,)
    report = json.loads((linear_store / "report.json").read_text())
    assert report["gate"]["lift"] == "linear"
