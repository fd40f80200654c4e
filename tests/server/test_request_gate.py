"""The request-time gate on /v1/predict and /v1/route: caps (422 naming the cap), beam 1 ≡
tree mode, ragged experts under dense-to-sparse, binary query parameters, and batch
invariance for every gate setting (server/kinds/_momlp.py, server/http/_predict.py)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from app_support import build_small_store, error_of, fake_app, running

from experts_store import Store
from router import Gate, PrototypeTree
from server._settings import Settings
from server.batching import Batcher
from server.kinds import GateRequest, MomlpModel
from server.pool import FakeExpertPool

pytestmark = pytest.mark.unit

GATES = [
    {},
    {"top_k": 3},
    {"top_k": 4, "gate": {"temperature": 0.5, "score": "dist"}},
    {"top_k": 5, "gate": {"min_weight": 0.1}},
    {"top_k": 5, "gate": {"top_p": 0.7, "temperature": 2.0}},
    {"gate": {"beam": [2, 2]}},
    {"gate": {"beam": [3], "min_weight": 0.05}},
    {"mode": "exact"},
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_store(tmp_path_factory.mktemp("gate") / "s", K=24, n=3, width=16, out=2)


async def test_beam_of_ones_serves_exactly_tree_mode(store: Path) -> None:
    x = np.random.default_rng(0).standard_normal((10_000, 3)).astype(np.float32)
    depth = PrototypeTree.load(Store.open(store).router_path).depth
    async with running(fake_app(store, max_rows=10_000)) as client:
        tree = (await client.post("/v1/predict", json={"inputs": x.tolist(), "mode": "tree"}))
        beam = await client.post(
            "/v1/predict", json={"inputs": x.tolist(), "gate": {"beam": [1] * depth}}
        )
    assert tree.status_code == beam.status_code == 200
    assert beam.json()["experts"] == tree.json()["experts"]
    assert beam.json()["outputs"] == tree.json()["outputs"]


@pytest.mark.parametrize(
    "body,cap",
    [
        ({"top_k": 9}, "max_top_k"),
        ({"gate": {"beam": [2, 9]}}, "max_beam"),
        ({"gate": {"temperature": 1e4}}, "max_temperature_ratio"),
        ({"gate": {"temperature": 1e-4}}, "max_temperature_ratio"),
    ],
)
async def test_beyond_a_cap_is_422_naming_it(
    store: Path, body: dict[str, object], cap: str
) -> None:
    async with running(fake_app(store)) as client:
        for path in ("/v1/predict", "/v1/route"):
            response = await client.post(path, json={"inputs": [[0.0, 0.0, 0.0]], **body})
            assert response.status_code == 422
            error = error_of(response)
            assert error["code"] == "invalid_input" and cap in error["message"]
            assert error["detail"]["cap"] == cap


async def test_a_temperature_beyond_the_ratio_is_told_the_range_it_may_take(
    store: Path,
) -> None:
    tau = Store.open(store).manifest.gate_spec.temperature
    async with running(fake_app(store, max_temperature_ratio=10.0)) as client:
        response = await client.post(
            "/v1/predict", json={"inputs": [[0.0, 0.0, 0.0]], "gate": {"temperature": 1e-30}}
        )
    assert response.status_code == 422
    message = error_of(response)["message"]
    # Below the range, so not "exceeds"; and the range is stated.
    assert "exceeds" not in message
    assert f"is outside [{tau / 10:.6g}, {tau * 10:.6g}]" in message, message
    assert error_of(response)["detail"]["allowed"].startswith("[")


@pytest.mark.parametrize(
    "gate,field",
    [
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"min_weight": "0.1"}, "min_weight"),
        ({"top_p": "1"}, "top_p"),
    ],
)
async def test_a_json_gate_number_given_as_a_string_or_bool_is_422_naming_it(
    store: Path, gate: dict[str, object], field: str
) -> None:
    # As every other number of a JSON body: refused, not coerced (a query string's "0.5" is
    # the binary body's way of giving one, and stays accepted there).
    async with running(fake_app(store)) as client:
        for path in ("/v1/predict", "/v1/route"):
            response = await client.post(
                path, json={"inputs": [[0.0, 0.0, 0.0]], "top_k": 2, "gate": gate}
            )
            assert response.status_code == 422, response.text
            assert [e["loc"] for e in error_of(response)["detail"]] == [["gate", field]]


async def test_dense_to_sparse_rows_report_their_own_experts(store: Path) -> None:
    x = np.random.default_rng(1).standard_normal((300, 3)).tolist()
    async with running(fake_app(store)) as client:
        body = {"inputs": x, "top_k": 6, "gate": {"min_weight": 0.08, "temperature": 0.5}}
        routed = (await client.post("/v1/route", json=body)).json()
        predicted = (await client.post("/v1/predict", json=body)).json()
    kept = [len(e) for e in routed["experts"]]
    assert min(kept) >= 1 and max(kept) > min(kept)
    assert predicted["experts"] == routed["experts"]
    for weights in routed["weights"]:
        assert abs(sum(weights) - 1.0) < 1e-6
        assert len(weights) == 1 or min(weights) >= 0.08 - 1e-12


async def test_binary_bodies_take_the_gate_as_query_parameters(store: Path) -> None:
    x = np.random.default_rng(2).standard_normal((50, 3)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    async with running(fake_app(store)) as client:
        as_json = await client.post(
            "/v1/predict", json={"inputs": x.tolist(), "gate": {"beam": [2, 2], "top_p": 0.9}}
        )
        as_npy = await client.post(
            "/v1/predict", params={"beam": "2,2", "top_p": "0.9"}, content=buf.getvalue(),
            headers={"Content-Type": "application/x-npy"},
        )
        bad = await client.post(
            "/v1/predict", params={"beam": "2,x"}, content=buf.getvalue(),
            headers={"Content-Type": "application/x-npy"},
        )
    assert as_npy.status_code == 200 and as_npy.json() == as_json.json()
    assert bad.status_code == 422


async def test_each_row_is_the_same_alone_and_inside_a_random_batch(store: Path) -> None:
    """1,000 rows, each gate: bitwise the same output alone as inside random batches."""
    s = Store.open(store)
    model = MomlpModel.open(s)
    settings = Settings(max_batch_wait_ms=0.0, max_batch_rows=4096, cache_bytes=10**7)
    pool = FakeExpertPool(settings)
    batcher = Batcher(model, pool, settings)
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((1_000, 3)).astype(np.float32))
    try:
        for options in GATES:
            gate = {**options.pop("gate", {}), **options} if options else {}
            beam = gate.pop("beam", None)
            request = GateRequest(**gate, beam=tuple(beam) if beam else None)  # type: ignore[arg-type]
            resolved = model.resolve(request, settings)
            assert isinstance(resolved, Gate)
            alone = torch.cat([
                torch.from_numpy((await batcher.submit(x[i : i + 1], resolved)).outputs)
                for i in range(1_000)
            ])
            order = torch.from_numpy(rng.permutation(1_000))
            cuts = np.sort(rng.choice(np.arange(1, 1_000), size=12, replace=False)).tolist()
            parts = torch.tensor_split(order, cuts)
            # The parts are submitted together so that they merge into shared batches.
            answers = await asyncio.gather(*(batcher.submit(x[p], resolved) for p in parts))
            together = torch.empty_like(alone)
            for p, answer in zip(parts, answers, strict=True):
                together[p] = torch.from_numpy(answer.outputs)
            assert torch.equal(alone, together), request
    finally:
        await batcher.close()
        await pool.close()
