"""Kind "hyper" on the real path: uvicorn on loopback, two Ray actors, httpx."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from live_support import serve_app

from experts_store import load_expert
from trainer.hyper import (
    HyperNetwork,
    PrimarySpec,
    generate,
    primary_forward,
    publish_hypernetwork,
)

pytestmark = [pytest.mark.integration, pytest.mark.ray]

M1, M2, OUT = 6, 5, 3


@dataclass
class HyperServer:
    url: str
    store: Path
    f: HyperNetwork


@pytest.fixture(scope="module")
def hyper_server(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HyperServer]:
    from server import Settings, create_app

    torch.manual_seed(3)
    f = HyperNetwork(M2, PrimarySpec(M1, (10,), OUT), depth=2, width=32)
    store = tmp_path_factory.mktemp("hyper") / "store"
    publish_hypernetwork(store, f)
    settings = Settings(store=store, port=0, actors=2, cache_bytes=1 << 20, watch_store=False,
                        max_rows=1000, max_conditions=1000)
    with serve_app(create_app(settings), name="momlp-uvicorn-hyper") as url:
        yield HyperServer(url, store, f)


def offline(f: HyperNetwork, x: np.ndarray, conditions: np.ndarray) -> np.ndarray:
    thetas = [generate(f, torch.from_numpy(c)) for c in conditions]
    return np.stack([primary_forward(torch.from_numpy(x[i : i + 1]), t, f.primary)[0].numpy()
                     for i, t in enumerate(thetas)])


def test_served_outputs_equal_g_of_f_on_a_thousand_random_pairs(
    hyper_server: HyperServer,
) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, M1)).astype(np.float32)
    conditions = rng.normal(size=(1000, M2)).astype(np.float32)
    with httpx.Client(timeout=120) as http:
        r = http.post(f"{hyper_server.url}/v1/predict",
                      json={"inputs": x.tolist(), "conditions": conditions.tolist(),
                            "return_stats": True})
    assert r.status_code == 200, r.text
    served = np.asarray(r.json()["outputs"], dtype=np.float32)
    expected = offline(hyper_server.f, x, conditions)
    assert np.abs(served - expected).max() <= 1e-6 * np.abs(expected).max()
    stats = r.json()["stats"]
    # A thousand conditions spread over every actor the pool runs: two on CPU, one per GPU.
    with httpx.Client(timeout=120) as http:
        listed = http.get(f"{hyper_server.url}/v1/experts").json()["actors"]
    actors = {a["name"] for a in listed}
    assert len(actors) == (2 if all(a["device"] == "cpu" for a in listed) else len(listed))
    assert len(stats["experts"]) == 1000 and {s["actor"] for s in stats["experts"]} == actors


def test_ten_conditions_miss_ten_times_then_hit_and_generate_matches(
    hyper_server: HyperServer, tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1000, M1)).astype(np.float32)
    table = rng.normal(size=(10, M2)).astype(np.float32)
    conditions = table[rng.integers(0, 10, size=1000)]
    body = {"inputs": x.tolist(), "conditions": conditions.tolist(), "return_stats": True}
    with httpx.Client(timeout=120) as http:
        first = http.post(f"{hyper_server.url}/v1/predict", json=body).json()
        again = http.post(f"{hyper_server.url}/v1/predict", json=body).json()
        generated = http.post(f"{hyper_server.url}/v1/generate",
                              json={"condition": table[0].tolist()})
        metrics = http.get(f"{hyper_server.url}/metrics").text
    assert sorted(s["cache"] for s in first["stats"]["experts"]) == ["miss"] * 10
    assert [s["cache"] for s in again["stats"]["experts"]] == ["hit"] * 10
    assert again["outputs"] == first["outputs"]
    assert "momlp_generations_total" in metrics
    path = tmp_path / "theta.safetensors"
    path.write_bytes(generated.content)
    rows = np.flatnonzero((conditions == table[0]).all(axis=1))
    with torch.no_grad():
        plain = load_expert(path)(torch.from_numpy(x[rows])).numpy()
    # Not bitwise: actors serve θ with aligned (zero-padded) widths for batch invariance,
    # which sums in another order than the file's plain forward.
    served = np.asarray(first["outputs"], dtype=np.float32)[rows]
    np.testing.assert_allclose(served, plain, rtol=1e-5, atol=1e-6)
