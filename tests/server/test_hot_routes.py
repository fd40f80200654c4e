"""The hot endpoints (predict, route) skip FastAPI's routing: same answers, errors and docs."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from app_support import build_small_store, error_of, fake_app, running
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from server.http._hot import HotRoute, HotRoutes
from server.kinds import GateRequest

pytestmark = pytest.mark.unit


@pytest.fixture
def store(make_store: Any) -> Path:
    path: Path = make_store(K=6, n=4, width=8, out=3)
    return path


async def test_only_an_exact_method_and_path_take_the_hot_endpoint() -> None:
    passed_on: list[tuple[str, str]] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        passed_on.append((scope["method"], scope["path"]))
        await PlainTextResponse("inner")(scope, receive, send)

    async def endpoint(request: Request) -> Response:
        route = request.scope["route"]
        return PlainTextResponse(f"hot {len(await request.body())} {route.path}")

    app = HotRoutes(inner, routes={("POST", "/v1/predict"): HotRoute(endpoint, "/v1/predict")})
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        hot = await client.post("/v1/predict", content=b"abc")
        wrong_method = await client.get("/v1/predict")
        other_path = await client.post("/v1/predict/", content=b"abc")
    assert hot.text == "hot 3 /v1/predict"
    assert wrong_method.text == other_path.text == "inner"
    assert passed_on == [("GET", "/v1/predict"), ("POST", "/v1/predict/")]


async def test_query_errors_name_the_parameter_and_unknown_ones_are_refused(
    store: Path,
) -> None:
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    binary = {"content": buf.getvalue(), "headers": {"Content-Type": "application/x-npy"}}
    async with running(fake_app(store)) as client:
        plain = await client.post("/v1/predict", json={"inputs": x.tolist()})
        # Was answered 200 as if no query had been sent.
        misspelt = await client.post("/v1/predict", params={"topk": "2"}, **binary)
        with_stats = await client.post("/v1/predict", params={"return_stats": "true"}, **binary)
        refused = {
            name: await client.post(path, params={name: value}, **binary)
            for path, name, value in (
                ("/v1/predict", "top_k", "0"),
                ("/v1/predict", "mode", "fastest"),
                ("/v1/route", "temperature", "inf"),
                ("/v1/route", "beam", "2,x"),
                ("/v1/predict", "return_stats", "maybe"),
            )
        }
    assert plain.status_code == 200
    assert misspelt.status_code == 422
    assert [entry["loc"] for entry in error_of(misspelt)["detail"]] == [["query", "topk"]]
    assert with_stats.status_code == 200 and with_stats.json()["stats"]["experts"]
    assert with_stats.json()["outputs"] == plain.json()["outputs"]
    for name, response in refused.items():
        assert response.status_code == 422, name
        error = error_of(response)
        assert error["code"] == "invalid_input"
        assert [entry["loc"] for entry in error["detail"]] == [["query", name]], name


def test_openapi_documents_the_query_parameters_the_endpoints_read(store: Path) -> None:
    paths = fake_app(store).openapi()["paths"]
    predict = {p["name"]: p for p in paths["/v1/predict"]["post"]["parameters"]}
    route = {p["name"] for p in paths["/v1/route"]["post"]["parameters"]}
    assert set(predict) == {
        "top_k", "mode", "temperature", "min_weight", "top_p", "beam", "score",
        "return_stats", "return_routing",
    }  # fmt: skip
    assert route == set(predict) - {"return_stats", "return_routing"}
    assert all(p["in"] == "query" and not p["required"] for p in predict.values())
    assert predict["top_k"]["schema"]["anyOf"][0] == {"minimum": 1, "type": "integer"}


async def test_v2_infer_answers_alike_on_the_hot_and_the_versioned_path(tmp_path: Path) -> None:
    # Only the served model's unversioned path is hot; the versioned one goes through FastAPI.
    store = build_small_store(tmp_path / "served", K=8, n=4, out=2)
    x = np.random.default_rng(1).normal(size=(6, 4)).astype(np.float32)
    body = {"inputs": [{"name": "input", "shape": [6, 4], "datatype": "FP32",
                        "data": x.ravel().tolist()}]}  # fmt: skip
    async with running(fake_app(store)) as client:
        version = (await client.get("/v2/models/served")).json()["versions"][0]
        hot = await client.post("/v2/models/served/infer", json=body)
        routed = await client.post(f"/v2/models/served/versions/{version}/infer", json=body)
        other = await client.post("/v2/models/elsewhere/infer", json=body)
        too_wide = await client.post(
            "/v2/models/served/infer",
            json={"inputs": [{**body["inputs"][0], "shape": [4, 6]}]},  # type: ignore[index]
        )
        metrics = (await client.get("/metrics")).text
    assert hot.status_code == routed.status_code == 200
    # The hot request is counted under its route template, as FastAPI's route would be.
    assert 'endpoint="/v2/models/{name}/infer",status="200"} 1.0' in metrics
    assert 'endpoint="/v2/models/{name}/infer",status="400"} 1.0' in metrics
    assert 'endpoint="/v2/models/{name}/versions/{version}/infer",status="200"} 1.0' in metrics
    assert hot.json()["outputs"] == routed.json()["outputs"]
    assert other.status_code == 404 and set(other.json()) == {"error"}
    assert too_wide.status_code == 400 and set(too_wide.json()) == {"error"}


async def test_route_answers_like_the_router_and_measures_its_cost_to_route_inline(
    store: Path,
) -> None:
    """/v1/route goes through the version's RouteRunner (inline once cheap), not a thread per
    request: 16 concurrent requests in threads had routed at a quarter of the rows/s."""
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    app = fake_app(store)
    async with running(app) as client:
        version = app.state.serving.current()
        assert version.route_runner.estimate_s(5) is None  # nothing routed yet
        answers = [(await client.post("/v1/route", json={"inputs": x.tolist()})) for _ in range(3)]
        estimate = version.route_runner.estimate_s(5)
        options = version.model.resolve(GateRequest(), app.state.serving.settings)
        want = version.model.route(torch.from_numpy(x), options)
    assert all(answer.status_code == 200 for answer in answers)
    assert answers[0].json() == answers[2].json()
    kept = (want.experts >= 0).sum(dim=1).tolist()
    rows = want.experts.tolist()
    assert answers[0].json()["experts"] == [row[:k] for row, k in zip(rows, kept, strict=True)]
    assert estimate is not None and estimate > 0
    assert version.route_runner.inline(5)  # a small store's route is well under the 2 ms bound
