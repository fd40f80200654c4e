"""The real server (uvicorn + Ray actors) driven over loopback with httpx and the client SDK."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from live_support import OUT, LiveServer

import client

pytestmark = [pytest.mark.integration, pytest.mark.ray]


def _x(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 3)).astype(np.float32)


def test_predictions_equal_a_local_computation_from_the_store_files(
    live_server: LiveServer,
) -> None:
    x = _x(100, seed=1)
    local = live_server.local
    with client.Client(live_server.url) as sdk:
        assert sdk.health() and sdk.ready()
        answer = sdk.predict(x.tolist(), mode="exact")
        binary = sdk.predict(x, mode="exact", binary=True)
    nearest, _ = local.nearest(x, 1)
    assert answer.experts == nearest.tolist()
    expected = np.zeros((100, OUT), dtype=np.float32)
    for expert_id in np.unique(nearest):
        rows = nearest[:, 0] == expert_id
        expected[rows] = local.expert(int(expert_id), x[rows])
    np.testing.assert_allclose(answer.outputs, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(binary.outputs, expected, rtol=1e-5, atol=1e-6)
    assert answer.store_version == local.manifest["store_version"]


def test_top2_equals_the_weighted_sum_of_the_two_experts(live_server: LiveServer) -> None:
    x = _x(30, seed=2)
    local = live_server.local
    idx, d2 = local.nearest(x, 2)
    logits = -d2 / local.manifest["temperature"]
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    expected = sum(
        weights[:, j : j + 1]
        * np.stack([local.expert(int(idx[r, j]), x[r : r + 1])[0] for r in range(30)])
        for j in range(2)
    )
    with client.Client(live_server.url) as sdk:
        answer = sdk.predict(x.tolist(), top_k=2)
    assert answer.experts == idx.tolist()
    np.testing.assert_allclose(answer.weights, weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(answer.outputs, expected, rtol=1e-4, atol=1e-5)


def test_stats_report_hits_misses_and_the_experts_size(live_server: LiveServer) -> None:
    local = live_server.local
    x = _x(200, seed=3)
    with client.Client(live_server.url) as sdk:
        routed = sdk.route(x.tolist())
        # An expert no earlier test can have loaded: pick by routing, ask twice.
        used = {e for (e,) in routed.experts}
        expert_id = max(used)
        row = x[[e for (e,) in routed.experts].index(expert_id)]
        first = sdk.predict([row.tolist()] * 3, return_stats=True)
        second = sdk.predict([row.tolist()], return_stats=True)
        experts = sdk.experts()
    assert first.stats is not None and second.stats is not None
    (stat,) = first.stats.experts
    (again,) = second.stats.experts
    assert stat.expert_id == expert_id and stat.rows == 3
    assert again.cache == "hit" and again.load_ms == 0.0
    params = local.manifest["experts"][expert_id]["params"]
    assert stat.expert_bytes == again.expert_bytes == 4 * params
    actor = next(a for a in experts.actors if a.name == stat.actor)
    if actor.device == "cpu":
        # 3 rows through widths 3 -> 24 -> 24 -> 2: the widest layer holds 24 + 24 float32 values.
        assert stat.activation_bytes == 3 * 4 * 48
    else:
        # A CUDA actor reports its allocator's peak for the whole padded row block instead.
        assert stat.activation_bytes >= 3 * 4 * 48
    assert stat.vram_bytes == stat.expert_bytes + stat.activation_bytes
    assert first.stats.vram_bytes == stat.vram_bytes
    assert first.stats.device_bytes[stat.actor] >= stat.expert_bytes
    holders = experts.experts[expert_id].actors
    assert stat.actor in holders
    assert expert_id in actor.resident and actor.alive
    assert actor.resident_bytes <= actor.budget_bytes == 1 << 20


def test_metrics_count_what_the_clients_saw(live_server: LiveServer) -> None:
    with client.Client(live_server.url) as sdk:
        before = sdk.metrics()
        answer = sdk.predict(_x(5, seed=4).tolist(), return_stats=True)
        after = sdk.metrics()

    def value(text: str, name: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(name + " ")]
        return float(lines[0].split()[-1]) if lines else 0.0

    assert answer.stats is not None
    hits, misses = answer.stats.hits, answer.stats.misses
    assert value(after, "momlp_cache_hits_total") - value(before, "momlp_cache_hits_total") == hits
    assert (
        value(after, "momlp_cache_misses_total") - value(before, "momlp_cache_misses_total")
        == misses
    )
    assert value(after, "momlp_rows_total") - value(before, "momlp_rows_total") == 5


def test_errors_over_the_wire(live_server: LiveServer) -> None:
    with httpx.Client(base_url=live_server.url) as http:
        wrong_dim = http.post("/v1/predict", json={"inputs": [[1.0, 2.0]]})
        too_many = http.post("/v1/predict", json={"inputs": [[0.0, 0.0, 0.0]] * 513})
        missing = http.get("/v1/nothing", headers={"X-Request-ID": "lb-trace-42"})
        nan = http.post(
            "/v1/predict",
            content=b'{"inputs": [[NaN, 0, 0]]}',
            headers={"Content-Type": "application/json"},
        )
    assert (wrong_dim.status_code, wrong_dim.json()["error"]["code"]) == (422, "invalid_input")
    assert (too_many.status_code, too_many.json()["error"]["code"]) == (413, "payload_too_large")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    assert nan.status_code == 422
    # Over real uvicorn too: the caller's request id comes back, or the server makes one.
    assert missing.headers["x-request-id"] == "lb-trace-42"
    assert len(wrong_dim.headers["x-request-id"]) == 16
    with client.Client(live_server.url) as sdk, pytest.raises(client.InvalidInput):
        sdk.predict([[1.0, 2.0]])


def test_async_client_under_concurrency(live_server: LiveServer) -> None:
    x = _x(64, seed=5)
    local = live_server.local

    async def run() -> list[client.Prediction]:
        async with client.AsyncClient(live_server.url) as sdk:
            return list(
                await asyncio.gather(
                    *(sdk.predict(x[i : i + 8].tolist(), mode="exact") for i in range(0, 64, 8))
                )
            )

    answers = asyncio.run(run())
    outputs = np.concatenate([np.asarray(a.outputs) for a in answers])
    nearest, _ = local.nearest(x, 1)
    expected = np.stack([local.expert(int(nearest[r, 0]), x[r : r + 1])[0] for r in range(64)])
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-6)
