"""The server's default top_k (MOMLP_DEFAULT_TOP_K) against a request's beam
(server/kinds/_momlp.py `MomlpModel.resolve`): the default is for flat gates, so a request
that gives only a beam is served its beam whatever the default, and a top_k the client did
send is still refused beside a beam."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from app_support import build_small_store, error_of, fake_app, running

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_store(tmp_path_factory.mktemp("gate-defaults") / "s", K=24, n=3)


async def test_a_beam_request_is_served_its_beam_under_a_default_top_k_of_two(
    store: Path,
) -> None:
    x = np.random.default_rng(5).standard_normal((40, 3)).astype(np.float32).tolist()
    body = {"inputs": x, "gate": {"beam": [2, 2]}}
    async with running(fake_app(store)) as client:
        want = {p: (await client.post(p, json=body)).json() for p in ("/v1/predict", "/v1/route")}
    async with running(fake_app(store, default_top_k=2)) as client:
        got = {p: await client.post(p, json=body) for p in ("/v1/predict", "/v1/route")}
        flat = await client.post("/v1/predict", json={"inputs": x})
        both = await client.post("/v1/predict", json={**body, "top_k": 2})
    for path, response in got.items():
        assert response.status_code == 200, response.text
        assert response.json()["experts"] == want[path]["experts"]
        assert response.json()["weights"] == want[path]["weights"]
    assert got["/v1/predict"].json()["outputs"] == want["/v1/predict"]["outputs"]
    # The default still sets the flat gate of a request that names no gate.
    assert flat.status_code == 200 and {len(e) for e in flat.json()["experts"]} == {2}
    # A top_k the client sent beside a beam is its own contradiction: still refused.
    assert both.status_code == 422 and error_of(both)["detail"]["field"] == "beam"
