"""The FastAPI app over a real small store and the in-process fake pool."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from app_support import (
    app_settings,
    build_small_store,
    expert_outputs,
    fake_app,
    fake_pool,
    manifest,
    nearest_k,
    prototypes,
    running,
)
from pydantic import ValidationError

from experts_store import Store
from server import Settings, create_app
from server.http._models import ExpertsResponse

pytestmark = pytest.mark.unit


@pytest.fixture
def store(make_store: object) -> Path:
    path: Path = make_store(K=8, n=4, width=16, out=2)  # type: ignore[operator]
    return path


def _inputs(rows: int, n: int = 4, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, n)).astype(np.float32)


async def test_health_ready_and_model(store: Path) -> None:
    async with running(fake_app(store)) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        ready = (await client.get("/readyz")).json()
        m = manifest(store)
        assert ready == {"status": "ready", "store_version": m["store_version"]}
        model = (await client.get("/v1/model")).json()
        assert model["input_dim"] == 4 and model["output_dim"] == 2
        assert model["num_experts"] == 8 and model["branching"] == 4
        assert model["total_expert_bytes"] == sum(e["bytes"] for e in m["experts"])
        assert model["max_expert_bytes"] == max(e["bytes"] for e in m["experts"])
        assert model["total_params"] == sum(e["params"] for e in m["experts"])
        assert model["prototypes"] is None
        with_protos = (await client.get("/v1/model?include_prototypes=true")).json()
        np.testing.assert_allclose(with_protos["prototypes"], prototypes(store), rtol=1e-6)


async def test_predict_equals_direct_forward_of_the_routed_expert(store: Path) -> None:
    x = _inputs(64)
    async with running(fake_app(store)) as client:
        routed = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
        answer = await client.post("/v1/predict", json={"inputs": x.tolist()})
    assert answer.status_code == 200
    body = answer.json()
    assert body["experts"] == routed["experts"]
    assert body["weights"] == [[1.0]] * 64
    assert body["store_version"] == manifest(store)["store_version"]
    assert body["stats"] is None
    experts = np.asarray(body["experts"])[:, 0]
    expected = np.zeros((64, 2), dtype=np.float32)
    for expert_id in np.unique(experts):
        mask = experts == expert_id
        expected[mask] = expert_outputs(store, int(expert_id), x[mask])
    np.testing.assert_allclose(body["outputs"], expected, rtol=1e-5, atol=1e-6)


async def test_exact_mode_routes_to_the_brute_force_nearest_prototype(store: Path) -> None:
    x = _inputs(200, seed=3)
    nearest, d2 = nearest_k(store, x, 1)
    async with running(fake_app(store)) as client:
        routed = (
            await client.post("/v1/route", json={"inputs": x.tolist(), "mode": "exact"})
        ).json()
        predicted = (
            await client.post("/v1/predict", json={"inputs": x.tolist(), "mode": "exact"})
        ).json()
    assert routed["experts"] == nearest.tolist()
    assert predicted["experts"] == nearest.tolist()
    np.testing.assert_allclose(routed["distances"], np.sqrt(d2), rtol=1e-5)
    assert all(evals >= 1 for evals in routed["distance_evals"])


async def test_top2_is_the_gate_weighted_sum_of_the_two_nearest_experts(store: Path) -> None:
    x = _inputs(40, seed=5)
    idx, d2 = nearest_k(store, x, 2)
    logits = -d2 / manifest(store)["temperature"]
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    expected = np.zeros((40, 2))
    for row in range(40):
        for j in range(2):
            out = expert_outputs(store, int(idx[row, j]), x[row : row + 1])[0]
            expected[row] += weights[row, j] * out
    async with running(fake_app(store)) as client:
        body = (await client.post("/v1/predict", json={"inputs": x.tolist(), "top_k": 2})).json()
    assert body["experts"] == idx.tolist()
    np.testing.assert_allclose(body["weights"], weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(body["outputs"], expected, rtol=1e-4, atol=1e-5)


async def test_stats_report_miss_then_hit_and_vram_of_the_expert(store: Path) -> None:
    m = manifest(store)
    x = _inputs(1, seed=7)
    # Without prefetch the first request itself waits for the load (see the report on prefetch).
    async with running(fake_app(store, prefetch=False)) as client:
        first = (
            await client.post("/v1/predict", json={"inputs": x.tolist(), "return_stats": True})
        ).json()
        second = (
            await client.post("/v1/predict", json={"inputs": x.tolist(), "return_stats": True})
        ).json()
    (stat1,) = first["stats"]["experts"]
    (stat2,) = second["stats"]["experts"]
    expert_id = first["experts"][0][0]
    assert stat1["expert_id"] == expert_id and stat1["rows"] == 1
    assert (stat1["cache"], stat2["cache"]) == ("miss", "hit")
    # float32 parameters (PReLU slopes included), no buffers without batchnorm.
    assert stat1["expert_bytes"] == 4 * m["experts"][expert_id]["params"]
    # widths 4 -> 16 -> 2, one row of float32: the largest layer holds 4+16 or 2*16 values.
    assert stat1["activation_bytes"] == 4 * max(4 + 16, 2 * 16, 16 + 2)
    assert stat1["vram_bytes"] == stat1["expert_bytes"] + stat1["activation_bytes"]
    assert first["stats"]["vram_bytes"] == stat1["vram_bytes"]
    assert first["stats"]["device_bytes"] == {stat1["actor"]: stat1["expert_bytes"]}
    assert len(first["stats"]["distance_evals"]) == 1
    assert first["stats"]["total_ms"] >= first["stats"]["queue_ms"] >= 0.0


async def test_binary_bodies_give_the_json_answer(store: Path) -> None:
    x = _inputs(16, seed=9)
    async with running(fake_app(store)) as client:
        as_json = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
        for array in (x, x.astype(np.float64), np.asfortranarray(x), x.astype(">f4")):
            buf = io.BytesIO()
            np.save(buf, array, allow_pickle=False)
            npy = await client.post(
                "/v1/predict",
                content=buf.getvalue(),
                headers={"Content-Type": "application/x-npy"},
            )
            assert npy.status_code == 200, npy.text
            np.testing.assert_allclose(npy.json()["outputs"], as_json["outputs"], rtol=1e-6)
        raw = await client.post(
            "/v1/predict?top_k=2&return_stats=true",
            content=x.astype("<f4").tobytes(),
            headers={"Content-Type": "application/octet-stream", "X-Momlp-Rows": "16"},
        )
        top2 = (await client.post("/v1/predict", json={"inputs": x.tolist(), "top_k": 2})).json()
    assert raw.status_code == 200, raw.text
    assert raw.json()["experts"] == top2["experts"]
    assert raw.json()["stats"] is not None


async def test_experts_lists_residency_after_a_prediction(store: Path) -> None:
    x = _inputs(1, seed=11)
    async with running(fake_app(store)) as client:
        before = (await client.get("/v1/experts")).json()
        used = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
        answer = await client.get("/v1/experts")
        after = answer.json()
    # Built from plain dicts (100,000 response models cost 1.06 s): still the documented shape.
    assert ExpertsResponse.model_validate_json(answer.content).model_dump() == after
    assert answer.headers["content-type"] == "application/json"
    assert [e["id"] for e in before["experts"]] == list(range(8))
    assert all(e["actors"] == [] for e in before["experts"])
    assert {a["name"] for a in before["actors"]} == {"actor-0", "actor-1"}
    expert_id = used["experts"][0][0]
    holders = after["experts"][expert_id]["actors"]
    assert len(holders) == 1
    actor = next(a for a in after["actors"] if a["name"] == holders[0])
    assert actor["resident"] == [expert_id] and actor["alive"]
    assert actor["resident_bytes"] == 4 * manifest(store)["experts"][expert_id]["params"]
    assert actor["budget_bytes"] == 1 << 20


def _summed(text: str, name: str) -> float:
    """A series summed over its actors (per-actor counters)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{actor=")
    ]
    assert values, f"{name} not in metrics"
    return sum(values)


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


async def test_metrics_counters_move(store: Path) -> None:
    x = _inputs(1, seed=13)
    async with running(fake_app(store, prefetch=False)) as client:
        await client.post("/v1/predict", json={"inputs": x.tolist()})
        await client.post("/v1/predict", json={"inputs": x.tolist()})
        await client.post("/v1/predict", json={"inputs": [[1.0]]})
        await client.get("/nope")
        response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    ok = 'momlp_requests_total{endpoint="/v1/predict",status="200"}'
    assert _sample(text, ok) == 2.0
    assert _sample(text, 'momlp_requests_total{endpoint="/v1/predict",status="422"}') == 1.0
    assert _sample(text, 'momlp_requests_total{endpoint="unmatched",status="404"}') == 1.0
    assert _sample(text, 'momlp_request_seconds_count{endpoint="/v1/predict"}') == 3.0
    assert _sample(text, "momlp_rows_total") == 2.0
    assert _sample(text, "momlp_cache_misses_total") == 1.0
    assert _sample(text, "momlp_cache_hits_total") == 1.0
    assert _summed(text, "momlp_cache_evictions_total") == 0.0
    # One series per actor: a restarted actor resets its own counter, not the sum.
    for name in ("momlp_cache_evictions_total", "momlp_expert_loads_total"):
        assert {f'{name}{{actor="actor-0"}}', f'{name}{{actor="actor-1"}}'} <= {
            line.rsplit(" ", 1)[0] for line in text.splitlines()
        }
    assert _sample(text, "momlp_expert_load_seconds_count") == 1.0
    assert _sample(text, "momlp_batch_rows_count") == 2.0
    assert _sample(text, "momlp_batch_rows_sum") == 2.0
    assert _sample(text, "momlp_queue_rows") == 0.0
    resident = [line for line in text.splitlines() if line.startswith("momlp_resident_bytes{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in resident) > 0


async def test_evictions_are_counted_when_the_budget_is_tight(store: Path) -> None:
    m = manifest(store)
    one_expert = 4 * max(e["params"] for e in m["experts"])
    x = _inputs(64, seed=17)
    app = fake_app(store, actors=1, cache_bytes=one_expert, prefetch=False)
    async with running(app) as client:
        routed = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
        experts = [row[0] for row in routed["experts"]]
        distinct = list(dict.fromkeys(experts))
        assert len(distinct) >= 3
        for expert_id in distinct[:3]:
            row = x[experts.index(expert_id)]
            await client.post("/v1/predict", json={"inputs": [row.tolist()]})
        text = (await client.get("/metrics")).text
    assert _sample(text, "momlp_cache_misses_total") == 3.0
    assert _summed(text, "momlp_cache_evictions_total") == 2.0
    assert _summed(text, "momlp_expert_loads_total") == 3.0
    # The bytes the cache's budget counts: the weights as loaded, not the file.
    assert _summed(text, "momlp_expert_load_bytes_total") == sum(
        4 * e["params"] for e in m["experts"] if e["id"] in distinct[:3]
    )


async def test_a_load_that_several_requests_waited_for_counts_once(store: Path) -> None:
    x = _inputs(64, seed=17)
    # A window long enough that the four requests are batched together, whatever the pace.
    app = fake_app(store, actors=1, max_batch_wait_ms=500.0, batch_gap_ms=0.0, prefetch=False)
    async with running(app) as client:
        routed = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
        expert = routed["experts"][0][0]
        rows = [row.tolist() for row, e in zip(x, routed["experts"], strict=True) if e[0] == expert]
        sent = [rows[i % len(rows)] for i in range(4)]
        answers = await asyncio.gather(
            *(client.post("/v1/predict", json={"inputs": [row], "return_stats": True})
              for row in sent)
        )
        text = (await client.get("/metrics")).text
    caches = [a.json()["stats"]["experts"][0]["cache"] for a in answers]
    assert caches == ["miss"] * 4
    assert _sample(text, "momlp_cache_misses_total") == 4.0
    assert _summed(text, "momlp_expert_loads_total") == 1.0


async def test_openapi_and_docs_are_served(store: Path) -> None:
    async with running(fake_app(store)) as client:
        spec = (await client.get("/openapi.json")).json()
        docs = await client.get("/docs")
    assert docs.status_code == 200
    predict = spec["paths"]["/v1/predict"]["post"]
    assert set(predict["requestBody"]["content"]) == {
        "application/json",
        "application/x-npy",
        "application/octet-stream",
    }
    assert {"/v1/route", "/v1/model", "/v1/experts", "/healthz", "/readyz", "/metrics"} <= set(
        spec["paths"]
    )


async def test_settings_defaults_apply_when_a_request_gives_no_top_k_or_mode(store: Path) -> None:
    x = _inputs(30, seed=19)
    nearest, _ = nearest_k(store, x, 2)
    async with running(fake_app(store, default_top_k=2, default_mode="exact")) as client:
        routed = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
        one = (await client.post("/v1/route", json={"inputs": x.tolist(), "top_k": 1})).json()
    assert routed["experts"] == nearest.tolist()
    assert one["experts"] == nearest[:, :1].tolist()


async def test_a_default_top_k_beyond_the_stores_experts_serves_all_of_them(
    store: Path,
) -> None:
    # Was a 422 "top_k=K+3 exceeds the K experts" on every request that named no top_k.
    k = Store.open(store).manifest.num_experts
    x = _inputs(10, seed=20)
    nearest, _ = nearest_k(store, x, k)
    settings = {"default_top_k": k + 3, "max_top_k": k + 3, "default_mode": "exact"}
    async with running(fake_app(store, **settings)) as client:
        routed = await client.post("/v1/route", json={"inputs": x.tolist()})
        asked = await client.post("/v1/route", json={"inputs": x.tolist(), "top_k": k + 1})
    assert routed.status_code == 200 and routed.json()["experts"] == nearest.tolist()
    assert asked.status_code == 422 and f"exceeds the {k} experts" in asked.text


def test_a_default_top_k_beyond_the_cap_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match=r"default_top_k \(MOMLP_DEFAULT_TOP_K\) 9 "
                       r"exceeds max_top_k \(MOMLP_MAX_TOP_K\) 8"):
        Settings(default_top_k=9)


async def test_the_experts_listing_is_built_off_the_event_loop_inside_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import server.http._routes as routes
    from server.serving import ServingState

    store = build_small_store(tmp_path / "store")
    app = create_app(app_settings(store), pool_factory=fake_pool)
    seen: list[tuple[str, int]] = []
    build = routes._experts_body

    def watched(version: Any, *args: Any) -> str:
        seen.append((threading.current_thread().name, version.in_flight))
        return build(version, *args)

    monkeypatch.setattr(routes, "_experts_body", watched)
    async with running(app) as client:
        answer = await client.get("/v1/experts")
        serving: ServingState = app.state.serving
        assert serving.version is not None and serving.version.in_flight == 0
    assert answer.status_code == 200
    assert [e["id"] for e in answer.json()["experts"]] == list(range(8))
    # On a thread of its own, while the version counted it as a request in it (a swap then
    # waits for it before freeing the version's rows).
    assert seen == [(seen[0][0], 1)] and seen[0][0] != threading.main_thread().name


async def test_the_queue_gauge_counts_the_rows_waiting_in_the_batcher(store: Path) -> None:
    class HeldBatcher:
        """Holds every submitted request until released; counts its rows as queued."""

        def __init__(self) -> None:
            self.queued_rows = 0
            self.entered = asyncio.Event()
            self.release = asyncio.Event()

        async def submit(self, x: Any, options: Any = None) -> Any:
            self.queued_rows += len(x)
            self.entered.set()
            await self.release.wait()
            raise RuntimeError("released")

        async def close(self) -> None:
            self.release.set()

    held = HeldBatcher()
    app = create_app(app_settings(store), pool_factory=fake_pool,
                     batcher_factory=lambda *args: held)
    async with running(app) as client:
        waiting = asyncio.create_task(
            client.post("/v1/predict", json={"inputs": _inputs(3).tolist()})
        )
        await held.entered.wait()
        text = (await client.get("/metrics")).text
        held.release.set()
        answer = await waiting
    assert _sample(text, "momlp_queue_rows") == 3.0
    assert answer.status_code == 500
