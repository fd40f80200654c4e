"""Every answer carries an X-Request-ID: the caller's when it is fit for a log line, else a
new one; a 500's error id is that id, so a user quoting either finds the traceback."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
from app_support import error_of, exploding_app, fake_app, running

from server.http._request_id import MAX_REQUEST_ID

pytestmark = pytest.mark.unit

X = [[0.1, 0.2, 0.3, 0.4]]
FRESH = re.compile(r"[0-9a-f]{16}")


@pytest.fixture
def store(make_store: Any) -> Path:
    path: Path = make_store(K=8, n=4, width=16, out=2)
    return path


async def test_every_answer_has_a_fresh_id_when_the_caller_sends_none(store: Path) -> None:
    async with running(fake_app(store, api_key="key-value")) as client:
        key = {"Authorization": "Bearer key-value"}
        answers = [
            await client.post("/v1/predict", json={"inputs": X}, headers=key),  # hot route
            await client.get("/v1/model", headers=key),  # through FastAPI
            await client.get("/healthz"),
            await client.post("/v1/predict", json={"inputs": [[1.0]]}, headers=key),  # 422
            await client.get("/v1/nowhere", headers=key),  # 404
            await client.get("/v1/model"),  # 401, before any route
            await client.post("/v2/models/nope/infer", json={}, headers=key),  # v2 error shape
        ]
    assert [a.status_code for a in answers] == [200, 200, 200, 422, 404, 401, 404]
    ids = [a.headers["x-request-id"] for a in answers]
    assert all(FRESH.fullmatch(i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    assert all(len(a.headers.get_list("x-request-id")) == 1 for a in answers)


@pytest.mark.parametrize("given", ["abc-123", "trace:4bf92f35/00f067aa", "x" * MAX_REQUEST_ID])
async def test_the_callers_id_comes_back(store: Path, given: str) -> None:
    async with running(fake_app(store)) as client:
        ok = await client.post("/v1/predict", json={"inputs": X}, headers={"X-Request-ID": given})
        refused = await client.post(
            "/v1/predict", json={"inputs": [[1.0]]}, headers={"X-Request-ID": given}
        )
    assert ok.status_code == 200 and ok.headers["x-request-id"] == given
    assert refused.status_code == 422 and refused.headers["x-request-id"] == given


@pytest.mark.parametrize("given", ["has space", "x" * (MAX_REQUEST_ID + 1), "tab\there"])
async def test_an_id_unfit_for_a_log_line_is_replaced(store: Path, given: str) -> None:
    async with running(fake_app(store)) as client:
        answer = await client.get("/healthz", headers={"X-Request-ID": given})
    assert FRESH.fullmatch(answer.headers["x-request-id"])


@pytest.mark.parametrize("given", [None, "client-chose-this"])
async def test_a_500s_error_id_is_the_request_id_and_its_log_line_names_it(
    store: Path, caplog: pytest.LogCaptureFixture, given: str | None
) -> None:
    headers = {"X-Request-ID": given} if given else {}
    caplog.set_level(logging.ERROR)
    async with running(exploding_app(store)) as client:
        response = await client.post("/v1/predict", json={"inputs": X}, headers=headers)
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    if given:
        assert request_id == given
    assert error_of(response)["detail"] == {"error_id": request_id}
    [record] = [r for r in caplog.records if "secret internals" in (r.exc_text or "")]
    assert record.getMessage().startswith(f"[error {request_id}] ")
