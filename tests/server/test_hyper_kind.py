"""Kind "hyper" served in-process (fake pool, real ActorCore caches): keys, hits and misses,
batch invariance, the pinned hypernetwork, caps and /v1/generate."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from app_support import app_settings, fake_app, running

from experts_store import (
    ExpertTooLarge,
    GeneratedRef,
    Store,
    condition_key,
    load_expert,
)
from server import create_app
from server.kinds import HyperModel
from server.pool import ROW_BLOCK, ActorCore, FakeExpertPool
from trainer.hyper import (
    HyperNetwork,
    PrimarySpec,
    generate,
    primary_forward,
    publish_hypernetwork,
)

pytestmark = pytest.mark.unit

M1, M2, OUT = 4, 5, 2


@pytest.fixture(scope="module")
def hyper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HyperNetwork]:
    """A random (untrained) f: 5 → 32 → 32 → |θ| for g: 4 → 8 → 2, and 3 named conditions."""
    torch.manual_seed(0)
    f = HyperNetwork(M2, PrimarySpec(M1, (8,), OUT), depth=1, width=32)
    root = tmp_path_factory.mktemp("hyper") / "store"
    table = torch.randn(3, M2, generator=torch.Generator().manual_seed(1))
    publish_hypernetwork(root, f, conditions=table, condition_ids=["a", "b", "c"])
    return root, f


def offline(f: HyperNetwork, x: np.ndarray, conditions: np.ndarray) -> np.ndarray:
    """g(x; f(I)) row by row with the trainer's own modules (independent of the server)."""
    return np.stack([
        primary_forward(torch.from_numpy(x[i : i + 1]), generate(f, torch.from_numpy(c)),
                        f.primary)[0].numpy()
        for i, c in enumerate(conditions)
    ])


def data(rows: int, distinct: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, M1)).astype(np.float32)
    table = rng.normal(size=(distinct, M2)).astype(np.float32)
    return x, table[rng.integers(0, distinct, size=rows)]


async def predict(client: Any, x: np.ndarray, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/predict", json={"inputs": x.tolist(), **body})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def test_outputs_equal_g_of_f_and_ten_conditions_miss_exactly_ten_times(
    hyper: tuple[Path, HyperNetwork],
) -> None:
    root, f = hyper
    x, conditions = data(1000, 10, seed=2)

    async def go() -> tuple[dict[str, Any], dict[str, Any], str]:
        async with running(fake_app(root, max_rows=2000)) as client:
            first = await predict(client, x, conditions=conditions.tolist(), return_stats=True)
            again = await predict(client, x, conditions=conditions.tolist(), return_stats=True)
            return first, again, (await client.get("/metrics")).text

    first, again, metrics = asyncio.run(go())
    expected = offline(f, x, conditions)
    served = np.asarray(first["outputs"], dtype=np.float32)
    assert np.abs(served - expected).max() <= 1e-6 * np.abs(expected).max()
    stats = first["stats"]["experts"]
    keys = {condition_key(Store.open(root).manifest.hyper.hypernetwork.sha256, c)  # type: ignore[union-attr]
            for c in conditions}
    assert {s["key"] for s in stats} == keys and len(keys) == 10
    assert [s["cache"] for s in stats] == ["miss"] * 10
    assert sum(s["rows"] for s in stats) == 1000
    assert all(s["generator_bytes"] > 0 and s["expert_bytes"] > 0 for s in stats)
    assert [s["cache"] for s in again["stats"]["experts"]] == ["hit"] * 10
    assert again["outputs"] == first["outputs"]
    assert 'momlp_generations_total{where="actor"} 10.0' in metrics


def test_a_rows_output_does_not_depend_on_the_other_conditions_in_its_batch(
    hyper: tuple[Path, HyperNetwork],
) -> None:
    root, _ = hyper
    x, conditions = data(64, 6, seed=3)
    rng = np.random.default_rng(4)

    async def go() -> tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
        async with running(fake_app(root)) as client:
            alone = [
                np.asarray((await predict(client, x[i : i + 1],
                                          conditions=conditions[i : i + 1].tolist()))["outputs"],
                           dtype=np.float32)
                for i in range(len(x))
            ]
            mixed = []
            for _ in range(6):
                pick = rng.choice(len(x), size=int(rng.integers(2, 40)), replace=False)
                other_x, other_c = data(len(pick), 9, seed=int(rng.integers(1 << 30)))
                batch_x = np.concatenate([x[pick], other_x])
                batch_c = np.concatenate([conditions[pick], other_c])
                out = await predict(client, batch_x, conditions=batch_c.tolist())
                mixed.append((pick, np.asarray(out["outputs"], dtype=np.float32)[: len(pick)]))
            return alone, mixed

    alone, mixed = asyncio.run(go())
    for pick, outputs in mixed:
        for j, i in enumerate(pick):
            assert np.array_equal(outputs[j], alone[i][0]), f"row {i} changed with its batch"


def test_generate_returns_a_plain_expert_file_with_identical_outputs(
    hyper: tuple[Path, HyperNetwork], tmp_path: Path
) -> None:
    root, f = hyper
    x, _ = data(50, 1, seed=5)
    condition = np.random.default_rng(6).normal(size=M2).astype(np.float32)

    async def go() -> tuple[bytes, str, dict[str, Any], dict[str, Any]]:
        async with running(fake_app(root)) as client:
            r = await client.post("/v1/generate", json={"condition": condition.tolist()})
            assert r.status_code == 200, r.text
            served = await predict(client, x, condition=condition.tolist())
            named = await client.post("/v1/generate", json={"condition_id": "b"})
            by_id = await predict(client, x, condition_ids=["b"], return_stats=True)
            assert named.status_code == 200
            return r.content, r.headers["x-momlp-key"], served, by_id

    content, key, served, by_id = asyncio.run(go())
    path = tmp_path / "theta.safetensors"
    path.write_bytes(content)
    expert = load_expert(path)  # the store's own loader: header, arch, dtypes all checked
    assert expert.arch.widths == (M1, 8, OUT) and expert.arch.prelu_init == 0.0
    outputs = np.asarray(served["outputs"], dtype=np.float32)
    with torch.no_grad():
        plain = expert(torch.from_numpy(x)).numpy()
        # The actor's way: whole blocks of ROW_BLOCK rows, zero-padded, each its own GEMMs.
        block = ROW_BLOCK["cpu"]
        padded = torch.from_numpy(np.concatenate([x, np.zeros((-len(x) % block, M1), np.float32)]))
        blocked = torch.cat([expert(padded[i : i + block]) for i in range(0, len(padded), block)])
    assert np.array_equal(blocked[: len(x)].numpy(), outputs)
    # One GEMM over all 50 rows may round differently (the host's BLAS picks its kernel by the
    # row count), so against it the file's outputs agree to float32 rounding only.
    np.testing.assert_allclose(plain, outputs, rtol=1e-5, atol=1e-6)
    sha = Store.open(root).manifest.hyper.hypernetwork.sha256  # type: ignore[union-attr]
    assert key == condition_key(sha, condition)
    assert by_id["experts"] == [[1]] * len(x)  # the table's index of "b"
    assert served["experts"] == [[]] * len(x)  # values the table does not hold


@pytest.mark.parametrize(
    ("body", "field", "status"),
    [
        ({}, "conditions", 422),
        ({"condition": [1.0, 2.0]}, "condition", 422),
        ({"conditions": [[0.0] * M2]}, "conditions", 422),  # 1 condition for 3 rows
        ({"conditions": [[1e39] + [0.0] * (M2 - 1)] * 3}, "conditions", 422),  # inf in float32
        ({"condition_ids": ["nope"]}, "condition_ids", 422),
        ({"condition": [0.0] * M2, "condition_ids": ["a"]}, None, 422),
        ({"conditions": [[float(i)] * M2 for i in range(3)]}, "conditions", 422),  # cap 2
        ({"condition": [0.0] * M2, "top_k": 2}, "top_k", 422),
    ],
)
def test_bad_conditions_are_refused_naming_the_field(
    hyper: tuple[Path, HyperNetwork], body: dict[str, Any], field: str | None, status: int
) -> None:
    root, _ = hyper
    x = np.zeros((3, M1), dtype=np.float32)

    async def go() -> Any:
        async with running(fake_app(root, max_conditions=2)) as client:
            return await client.post("/v1/predict", json={"inputs": x.tolist(), **body})

    r = asyncio.run(go())
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_input"
    if field is not None:
        detail = error["detail"]
        assert detail.get("field") == field, error
    if body.get("conditions") and len(body["conditions"]) == 3 and body["conditions"][0][0] == 0:
        assert error["detail"]["cap"] == "max_conditions"


def test_a_momlp_store_refuses_conditions_and_generate(make_store: Any) -> None:
    root = make_store(K=4, n=4)

    async def go() -> tuple[Any, Any]:
        async with running(fake_app(root)) as client:
            r = await client.post("/v1/predict", json={"inputs": [[0.0] * 4],
                                                       "condition": [1.0]})
            g = await client.post("/v1/generate", json={"condition": [1.0]})
            return r, g

    r, g = asyncio.run(go())
    assert r.status_code == 422 and r.json()["error"]["detail"]["field"] == "condition"
    assert g.status_code == 404 and g.json()["error"]["code"] == "not_found"


def test_startup_fails_when_f_and_one_theta_exceed_the_budget(
    hyper: tuple[Path, HyperNetwork],
) -> None:
    root, _ = hyper
    model = HyperModel.open(Store.open(root))
    budget = model.generator.nbytes + model.spec.theta_nbytes - 1
    app = create_app(app_settings(root, cache_bytes=budget),
                     pool_factory=lambda s: FakeExpertPool(s))

    async def go() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(ExpertTooLarge):
        asyncio.run(go())


def test_the_actor_pins_f_and_caches_theta_within_its_budget(
    hyper: tuple[Path, HyperNetwork],
) -> None:
    root, f = hyper
    model = HyperModel.open(Store.open(root))
    theta = model.spec.theta_nbytes
    budget = model.generator.nbytes + 3 * theta  # room for f and three θ
    core = ActorCore(name="a", budget_bytes=budget, cache_policy="lru")
    x, conditions = data(40, 40, seed=7)
    conditions = np.unique(conditions, axis=0)
    for i, c in enumerate(conditions):
        key = condition_key(model.generator.sha256, c)
        ref: GeneratedRef = model.key_ref(key, torch.from_numpy(c), -1)
        reply = core.run([(ref, x[i : i + 1])])
        outcome = reply.results[0]
        assert outcome.error is None and not outcome.hit and outcome.key == key
        assert np.abs(outcome.outputs - offline(f, x[i : i + 1], c[None])).max() < 1e-6
        assert reply.device_bytes <= budget
        assert model.generator.sha256 in reply.resident  # f never leaves
    assert core.cache.resident_bytes == budget
    assert core.cache.stats.evictions == len(conditions) - 3


def test_prototype_store_serves_what_its_materialized_store_serves(tmp_path: Path) -> None:
    from experts_store import materialize_store
    from router import PrototypeTree

    torch.manual_seed(8)
    f = HyperNetwork(M1, PrimarySpec(M1, (8,), OUT), depth=1, width=32)
    prototypes = torch.randn(12, M1, generator=torch.Generator().manual_seed(9))
    tree = PrototypeTree.build(prototypes, branching=4, seed=0)
    source = tmp_path / "hyper"
    publish_hypernetwork(source, f, conditions=prototypes,
                         condition_ids=[str(k) for k in range(12)], router=tree)
    plain = materialize_store(source, tmp_path / "plain")
    assert plain.kind == "momlp" and plain.num_experts == 12 and plain.routing == "exact"
    x = np.random.default_rng(10).normal(size=(300, M1)).astype(np.float32)

    async def serve(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        async with running(fake_app(root)) as client:
            routed = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
            model = (await client.get("/v1/model")).json()
            return await predict(client, x, return_stats=True), {**routed, "model": model}

    hyper_answer, hyper_route = asyncio.run(serve(source))
    plain_answer, plain_route = asyncio.run(serve(tmp_path / "plain"))
    # Both describe a mixture of the 12 experts rows are routed to.
    assert hyper_route.pop("model")["num_experts"] == plain_route.pop("model")["num_experts"] == 12
    assert hyper_answer["outputs"] == plain_answer["outputs"]  # bit for bit
    assert hyper_answer["experts"] == plain_answer["experts"]
    distances = torch.cdist(torch.from_numpy(x).double(), prototypes.double())
    nearest = distances.argmin(dim=1)
    assert [e[0] for e in hyper_answer["experts"]] == nearest.tolist()
    # /v1/route measures the same distance to the chosen prototype in both stores.
    assert hyper_route["distances"] == plain_route["distances"]
    np.testing.assert_allclose(
        [d[0] for d in hyper_route["distances"]], distances.min(dim=1).values.numpy(), rtol=1e-5
    )
    expected = offline(f, x, prototypes[nearest].numpy())
    served = np.asarray(hyper_answer["outputs"], dtype=np.float32)
    assert np.abs(served - expected).max() <= 1e-6 * np.abs(expected).max()


def test_a_third_hypernetwork_releases_the_oldest_pin(tmp_path: Path) -> None:
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        f = HyperNetwork(M2, PrimarySpec(M1, (8,), OUT), depth=1, width=32)
        publish_hypernetwork(tmp_path / f"s{seed}", f)
        models.append(HyperModel.open(Store.open(tmp_path / f"s{seed}")))
    budget = sum(m.generator.nbytes for m in models[:2]) + 2 * models[0].spec.theta_nbytes
    core = ActorCore(name="a", budget_bytes=budget, cache_policy="lru")
    x, c = data(1, 1, seed=11)
    for model in models:
        key = condition_key(model.generator.sha256, c[0])
        reply = core.run([(model.key_ref(key, torch.from_numpy(c[0]), -1), x)])
        assert reply.results[0].error is None and reply.device_bytes <= budget
    assert core.pinned() == [m.generator.sha256 for m in models[1:]]
    assert models[0].generator.sha256 not in core.resident()  # released, then evicted


def test_a_new_store_version_releases_the_pinned_hypernetworks(tmp_path: Path) -> None:
    from app_support import build_small_store

    torch.manual_seed(4)
    f = HyperNetwork(M2, PrimarySpec(M1, (8,), OUT), depth=1, width=32)
    publish_hypernetwork(tmp_path / "hyper", f)
    model = HyperModel.open(Store.open(tmp_path / "hyper"))
    # The next version is another kind, with experts larger than the θ that fits beside f.
    theta = model.spec.theta_nbytes
    plain = Store.open(build_small_store(tmp_path / "plain", K=2, n=M1, width=theta // 4))
    (expert, *_) = plain.expert_refs()
    assert expert.nbytes > theta
    budget = model.generator.nbytes + theta + 16
    assert budget < model.generator.nbytes + expert.nbytes
    core = ActorCore(name="a", budget_bytes=budget, cache_policy="lru", lease_timeout_s=1.0)
    x, c = data(1, 1, seed=13)
    key = condition_key(model.generator.sha256, c[0])
    generated = core.run([(model.key_ref(key, torch.from_numpy(c[0]), -1), x)])
    assert generated.results[0].error is None
    assert core.pinned() == [model.generator.sha256]

    core.forget_popularity()  # what every actor hears when a new version goes live

    assert core.pinned() == []
    reply = core.run([(expert, x)])
    assert reply.results[0].error is None, reply.results[0].error
    assert reply.device_bytes <= budget
    # Back to a hyper version: f is pinned again by its next generation, same answer.
    again = core.run([(model.key_ref(key, torch.from_numpy(c[0]), -1), x)])
    assert again.results[0].error is None and core.pinned() == [model.generator.sha256]
    np.testing.assert_array_equal(again.results[0].outputs, generated.results[0].outputs)


def test_v2_infer_takes_x_and_condition_rows(hyper: tuple[Path, HyperNetwork]) -> None:
    root, _ = hyper
    x, conditions = data(8, 3, seed=12)
    rows = np.concatenate([x, conditions], axis=1)

    async def go() -> tuple[Any, dict[str, Any]]:
        async with running(fake_app(root)) as client:
            meta = (await client.get(f"/v2/models/{root.name}")).json()
            r = await client.post(f"/v2/models/{root.name}/infer", json={"inputs": [
                {"name": "input", "shape": list(rows.shape), "datatype": "FP32",
                 "data": rows.reshape(-1).tolist()}]})
            assert r.status_code == 200, r.text
            v1 = await predict(client, x, conditions=conditions.tolist())
            return (meta, r.json()), v1

    (meta, v2), v1 = asyncio.run(go())
    assert meta["inputs"][0]["shape"] == [-1, M1 + M2]
    out = next(o for o in v2["outputs"] if o["name"] == "output")
    assert np.array_equal(np.asarray(out["data"], dtype=np.float32).reshape(8, OUT),
                          np.asarray(v1["outputs"], dtype=np.float32))


def test_v2_rows_obey_the_cap_on_distinct_conditions(hyper: tuple[Path, HyperNetwork]) -> None:
    # Each new condition costs a θ generation and cache room: /v2 takes [x, I] rows whole,
    # and its rows must meet /v1's cap.
    root, _ = hyper
    x, conditions = data(6, 3, seed=13)
    rows = np.concatenate([x, conditions], axis=1)
    distinct = len(np.unique(conditions, axis=0))

    async def go(cap: int) -> Any:
        async with running(fake_app(root, max_conditions=cap)) as client:
            return await client.post(f"/v2/models/{root.name}/infer", json={"inputs": [
                {"name": "input", "shape": list(rows.shape), "datatype": "FP32",
                 "data": rows.reshape(-1).tolist()}]})

    refused, served = asyncio.run(go(distinct - 1)), asyncio.run(go(distinct))
    assert refused.status_code == 400, refused.text
    assert "max_conditions" in refused.json()["error"]
    assert served.status_code == 200, served.text


def test_a_condition_that_overflows_theta_is_refused_not_nan(
    hyper: tuple[Path, HyperNetwork]
) -> None:
    # Finite in float32, but f(I) overflows: the answers were `null` (v1) and a θ file of NaN.
    root, _ = hyper
    x = np.zeros((2, M1), dtype=np.float32)
    huge = [3e38] * M2

    async def go() -> tuple[Any, Any]:
        async with running(fake_app(root)) as client:
            predicted = await client.post(
                "/v1/predict", json={"inputs": x.tolist(), "condition": huge}
            )
            generated = await client.post("/v1/generate", json={"condition": huge})
            return predicted, generated

    predicted, generated = asyncio.run(go())
    assert predicted.status_code == 422, predicted.text
    assert "not finite" in predicted.json()["error"]["message"]
    assert "its condition" in predicted.json()["error"]["message"]
    assert generated.status_code == 422, generated.text
    assert generated.json()["error"]["detail"]["field"] == "condition"


def test_generate_takes_json_only_as_predict_does(hyper: tuple[Path, HyperNetwork]) -> None:
    root, _ = hyper

    async def go() -> Any:
        async with running(fake_app(root)) as client:
            return await client.post(
                "/v1/generate", content=b'{"condition_id": "a"}',
                headers={"Content-Type": "text/plain"},
            )

    answer = asyncio.run(go())
    assert answer.status_code == 415, answer.text
    assert answer.json()["error"]["code"] == "unsupported_media_type"


def test_a_corrupt_hypernetwork_is_503_naming_its_file(tmp_path: Path) -> None:
    torch.manual_seed(3)
    f = HyperNetwork(M2, PrimarySpec(M1, (8,), OUT), depth=1, width=32)
    root = tmp_path / "store"
    publish_hypernetwork(root, f, conditions=torch.randn(2, M2), condition_ids=["a", "b"])
    f_file = Store.open(root).manifest.hyper.hypernetwork.file  # type: ignore[union-attr]
    raw = bytearray((root / f_file).read_bytes())
    raw[-3] ^= 0xFF
    (root / f_file).write_bytes(bytes(raw))
    x = np.zeros((1, M1), dtype=np.float32)

    async def call() -> httpx.Response:
        async with running(fake_app(root)) as client:
            return await client.post(
                "/v1/predict", json={"inputs": x.tolist(), "condition_ids": ["a"]}
            )

    answer = asyncio.run(call())
    assert answer.status_code == 503
    message = answer.json()["error"]["message"]
    assert f"hypernetwork {f_file}: checksum mismatch" in message
    assert "expert -1" not in message


def test_get_v1_model_shows_the_generator_and_the_named_conditions(
    hyper: tuple[Path, HyperNetwork],
) -> None:
    root, _ = hyper

    async def go() -> dict[str, Any]:
        async with running(fake_app(root)) as client:
            body: dict[str, Any] = (await client.get("/v1/model")).json()
            return body

    model = asyncio.run(go())
    spec = Store.open(root).manifest.hyper
    assert spec is not None
    # Requests bring their conditions: no expert a row is routed to by the store itself.
    assert model["kind"] == "hyper" and model["num_experts"] == 0 and model["pmoe"] is None
    assert model["hyper"] == {
        "condition_dim": M2, "theta_bytes": spec.theta_nbytes,
        "generator_bytes": 4 * spec.hypernetwork.params, "primary_widths": [M1, 8, OUT],
        "condition_source": "request", "condition_ids": ["a", "b", "c"],
    }


def test_a_missing_f_is_503_naming_it_as_the_store_does_not_where_it_lies(
    hyper: tuple[Path, HyperNetwork], tmp_path: Path
) -> None:
    import shutil

    root = Path(shutil.copytree(hyper[0], tmp_path / "store"))
    spec = Store.open(root).manifest.hyper
    assert spec is not None
    name = spec.hypernetwork.file

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with running(fake_app(root)) as client:
            (root / name).unlink()
            served = await client.post("/v1/predict", json={"inputs": [[0.0] * M1],
                                                            "condition": [0.5] * M2})
            generated = await client.post("/v1/generate", json={"condition_id": "a"})
            return served, generated

    for response in asyncio.run(go()):
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "expert_unavailable" and error["detail"]["expert_id"] == -1
        assert f"hypernetwork {name}: file missing: {name}" in error["detail"]["reason"]
        assert str(root) not in response.text and str(root.resolve()) not in response.text
