"""Every error case answers its status with the one error JSON shape, and nothing else leaks."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from app_support import (
    BlockingPool,
    app_settings,
    error_of,
    exploding_app,
    fake_app,
    fake_pool,
    manifest,
    running,
)
from fastapi import FastAPI

from server import create_app
from server._settings import Settings
from server.pool import ExpertPool

pytestmark = pytest.mark.unit

X = [[0.1, 0.2, 0.3, 0.4]]


@pytest.fixture
def store(make_store: Any) -> Path:
    path: Path = make_store(K=8, n=4, width=16, out=2)
    return path


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def _npy_header(text: bytes) -> bytes:
    """A version 1.0 .npy preamble around `text`, padded as numpy pads its own."""
    text += b" " * (64 - (10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text


NPY = {"Content-Type": "application/x-npy"}
JSON = {"Content-Type": "application/json"}
RAW = {"Content-Type": "application/octet-stream"}

INVALID_JSON_BODIES: list[tuple[str, bytes]] = [
    ("wrong dimension", b'{"inputs": [[1, 2, 3]]}'),
    ("ragged rows", b'{"inputs": [[1, 2, 3, 4], [1, 2, 3]]}'),
    ("a string number", b'{"inputs": [["1", 2, 3, 4]]}'),
    ("a boolean", b'{"inputs": [[true, 2, 3, 4]]}'),
    ("null in a row", b'{"inputs": [[null, 2, 3, 4]]}'),
    ("NaN", b'{"inputs": [[NaN, 2, 3, 4]]}'),
    ("Infinity", b'{"inputs": [[1, -Infinity, 3, 4]]}'),
    ("overflows float32", b'{"inputs": [[1e39, 2, 3, 4]]}'),
    ("empty batch", b'{"inputs": []}'),
    ("empty rows", b'{"inputs": [[]]}'),
    ("flat list", b'{"inputs": [1, 2, 3, 4]}'),
    ("no inputs", b'{"top_k": 1}'),
    ("top_k 0", b'{"inputs": [[1, 2, 3, 4]], "top_k": 0}'),
    ("top_k above K", b'{"inputs": [[1, 2, 3, 4]], "top_k": 9}'),
    ("top_k a float", b'{"inputs": [[1, 2, 3, 4]], "top_k": 1.5}'),
    ("bad mode", b'{"inputs": [[1, 2, 3, 4]], "mode": "fastest"}'),
    ("unknown field", b'{"inputs": [[1, 2, 3, 4]], "topk": 2}'),
    ("not JSON", b'{"inputs": [[1, 2, 3, 4]'),
    ("JSON but not an object", b"[[1, 2, 3, 4]]"),
    ("empty body", b""),
]


@pytest.mark.parametrize(
    ("case", "body"), INVALID_JSON_BODIES, ids=[c for c, _ in INVALID_JSON_BODIES]
)
async def test_invalid_json_bodies_are_422(store: Path, case: str, body: bytes) -> None:
    async with running(fake_app(store)) as client:
        for path in ("/v1/predict", "/v1/route"):
            response = await client.post(
                path, content=body, headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 422, (case, response.text)
            assert error_of(response)["code"] == "invalid_input"


INVALID_BINARY: list[tuple[str, bytes, dict[str, str | bytes], str]] = [
    ("npy int64", _npy(np.ones((2, 4), dtype=np.int64)), NPY, ""),
    ("npy object (pickle)", _npy(np.array([[1.0, 2, 3, 4]], dtype=object)), NPY, ""),
    ("npy 3-D", _npy(np.ones((1, 2, 4), dtype=np.float32)), NPY, ""),
    ("npy wrong dimension", _npy(np.ones((2, 3), dtype=np.float32)), NPY, ""),
    ("npy NaN", _npy(np.full((2, 4), np.nan, dtype=np.float32)), NPY, ""),
    ("npy truncated", _npy(np.ones((2, 4), dtype=np.float32))[:-4], NPY, ""),
    ("not npy", b"hello world", NPY, ""),
    ("raw without rows header", np.ones(8, "<f4").tobytes(), RAW, ""),
    ("raw size mismatch", np.ones(7, "<f4").tobytes(), {**RAW, "X-Momlp-Rows": "2"}, ""),
    ("raw Inf", np.full(4, np.inf, "<f4").tobytes(), {**RAW, "X-Momlp-Rows": "1"}, ""),
    ("raw rows not a number", np.ones(4, "<f4").tobytes(), {**RAW, "X-Momlp-Rows": "x"}, ""),
    ("query top_k 0", np.ones(4, "<f4").tobytes(), {**RAW, "X-Momlp-Rows": "1"}, "?top_k=0"),
    ("query top_k text", np.ones(4, "<f4").tobytes(), {**RAW, "X-Momlp-Rows": "1"}, "?top_k=a"),
    ("query bad mode", np.ones(4, "<f4").tobytes(), {**RAW, "X-Momlp-Rows": "1"}, "?mode=x"),
    # A digit int() refuses ("²".isdigit() is True): was a 500.
    ("raw rows a superscript", np.ones(4, "<f4").tobytes(), {**RAW, "X-Momlp-Rows": b"\xb2"},
     ""),
    # A 1.0 header numpy re-reads through `tokenize`, which raises its own error: was a 500.
    ("npy header unclosed", _npy_header(b"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4")
     + bytes(16), NPY, ""),
]


@pytest.mark.parametrize(
    ("case", "body", "headers", "query"), INVALID_BINARY, ids=[c[0] for c in INVALID_BINARY]
)
async def test_invalid_binary_bodies_are_422(
    store: Path, case: str, body: bytes, headers: dict[str, str | bytes], query: str
) -> None:
    async with running(fake_app(store)) as client:
        response = await client.post(f"/v1/predict{query}", content=body, headers=headers)
    assert response.status_code == 422, (case, response.text)
    assert error_of(response)["code"] == "invalid_input"


async def test_unsupported_media_type_is_415(store: Path) -> None:
    async with running(fake_app(store)) as client:
        response = await client.post(
            "/v1/predict", content=b"1,2,3,4", headers={"Content-Type": "text/csv"}
        )
    assert response.status_code == 415
    assert error_of(response)["code"] == "unsupported_media_type"


async def test_the_body_headers_are_read_as_http_defines_them(store: Path) -> None:
    """Media type case and parameters do not matter, no Content-Type means JSON, and of a
    repeated header the first counts (the parse reads all three in one pass)."""
    body = b'{"inputs": [[0.1, 0.2, 0.3, 0.4]]}'
    raw = np.ones((2, 4), "<f4").tobytes()
    async with running(fake_app(store)) as client:
        upper = await client.post(
            "/v1/predict", content=body,
            headers={"Content-Type": "Application/JSON; charset=utf-8"},
        )
        missing = await client.post("/v1/predict", content=body)
        bare = await client.post("/v1/predict", content=body, headers={"Content-Type": ""})
        repeated = await client.post(
            "/v1/predict", content=raw,
            headers=[("Content-Type", "application/octet-stream"), ("X-Momlp-Rows", "2"),
                     ("X-Momlp-Rows", "1")],
        )
        first_wrong = await client.post(
            "/v1/predict", content=raw,
            headers=[("Content-Type", "application/octet-stream"), ("X-Momlp-Rows", "1"),
                     ("X-Momlp-Rows", "2")],
        )
    assert upper.status_code == 200, upper.text
    assert missing.status_code == 200, missing.text
    assert bare.status_code == 415, bare.text  # an empty media type is no media type
    assert repeated.status_code == 200, repeated.text
    assert len(repeated.json()["outputs"]) == 2
    assert first_wrong.status_code == 422, first_wrong.text


async def test_too_many_rows_is_413_in_every_body_form(store: Path) -> None:
    x = np.zeros((5, 4), dtype=np.float32)
    async with running(fake_app(store, max_rows=4)) as client:
        answers = [
            await client.post("/v1/predict", json={"inputs": x.tolist()}),
            await client.post("/v1/predict", content=_npy(x), headers=NPY),
            await client.post(
                "/v1/predict", content=x.tobytes(), headers={**RAW, "X-Momlp-Rows": "5"}
            ),
            await client.post("/v1/route", json={"inputs": x.tolist()}),
        ]
        ok = await client.post("/v1/predict", json={"inputs": x[:4].tolist()})
    for response in answers:
        assert response.status_code == 413, response.text
        error = error_of(response)
        assert error["code"] == "payload_too_large"
        assert error["detail"] == {"rows": 5, "max_rows": 4}
    assert ok.status_code == 200


@pytest.mark.parametrize("rows", ["9" * 5_000, " 0" + "1" * 4_400, "99999"])
async def test_a_row_count_header_of_any_length_is_413_not_a_server_error(
    store: Path, rows: str, caplog: pytest.LogCaptureFixture
) -> None:
    # int() refuses more than 4,300 digits: such an X-Momlp-Rows was a logged 500.
    caplog.set_level(logging.ERROR)
    x = np.zeros((1, 4), dtype=np.float32)
    async with running(fake_app(store, max_rows=4)) as client:
        refused = await client.post(
            "/v1/predict", content=x.tobytes(), headers={**RAW, "X-Momlp-Rows": rows}
        )
        ok = await client.post(
            "/v1/predict", content=x.tobytes(), headers={**RAW, "X-Momlp-Rows": "0001"}
        )
    assert refused.status_code == 413, refused.text
    assert error_of(refused)["code"] == "payload_too_large"
    assert error_of(refused)["detail"]["max_rows"] == 4
    assert ok.status_code == 200, ok.text
    assert not caplog.records


async def test_a_row_count_header_is_digits_and_a_signed_one_is_422_at_every_length(
    store: Path,
) -> None:
    # int() read "+1" as 1 (served) and "+" with 20 digits as a number (413), but refused "+"
    # with 5,000 digits (422), where the same digits unsigned were a 413. A row count is
    # written as Content-Length is: digits, leading zeros and the blanks around them allowed.
    x = np.zeros((1, 4), dtype=np.float32)
    served = ["1", "0001", " 1", "1\t", "0" * 5_000 + "1"]
    too_many = ["9" * 20, "9" * 5_000, "0" * 10 + "9" * 5_000]
    refused = [sign + digits for sign in "+-" for digits in ("1", "9" * 20, "9" * 5_000)]
    refused += ["1_0", "1.0", "1e3", "0x1", "", " ", "1 1"]
    async with running(fake_app(store, max_rows=4)) as client:
        async def post(rows: str) -> httpx.Response:
            return await client.post(
                "/v1/predict", content=x.tobytes(), headers={**RAW, "X-Momlp-Rows": rows}
            )

        answers = {rows: await post(rows) for rows in served + too_many + refused}
    for rows in served:
        assert answers[rows].status_code == 200, (rows[:20], answers[rows].text)
    for rows in too_many:
        assert answers[rows].status_code == 413, (rows[:20], answers[rows].text)
        assert error_of(answers[rows])["detail"] == {"max_rows": 4}
    for rows in refused:
        assert answers[rows].status_code == 422, (rows[:20], answers[rows].text)
        assert "X-Momlp-Rows must be a row count in decimal digits" in (
            error_of(answers[rows])["message"]
        ), rows[:20]


async def test_rows_far_over_the_limit_are_refused_before_the_json_parse(store: Path) -> None:
    # A body under the byte limit with many short rows was parsed whole (holding the GIL:
    # 1.9 s of the whole server for 33 MB) before its row count was refused.
    many = json.dumps({"inputs": [[0, 0, 0, 0]] * 10_000}).encode()
    # Within the limits, padded past the size where bodies are scanned: still served.
    padded = json.dumps({"inputs": X * 8}).encode()[:-1] + b" " * 70_000 + b"}"
    v2 = {"inputs": [{"name": "input", "shape": [10_000, 4], "datatype": "FP32",
                      "data": [0] * 40_000}]}
    async with running(fake_app(store, max_rows=8)) as client:
        refused = await client.post("/v1/predict", content=many, headers=JSON)
        served = await client.post("/v1/predict", content=padded, headers=JSON)
        refused_v2 = await client.post(f"/v2/models/{store.name}/infer", json=v2)
    assert refused.status_code == 413, refused.text
    assert error_of(refused)["code"] == "payload_too_large"
    assert error_of(refused)["detail"] == {"arrays": 10_001, "max": 32}
    assert served.status_code == 200, served.text
    assert refused_v2.status_code == 413 and "commas" in refused_v2.json()["error"]


async def test_body_over_the_byte_limit_is_413_by_content_length(store: Path) -> None:
    async with running(fake_app(store, max_body_bytes=1024)) as client:
        response = await client.post(
            "/v1/predict", content=b"x" * 1025, headers={**RAW, "X-Momlp-Rows": "1"}
        )
    assert response.status_code == 413
    assert error_of(response)["detail"] == {"bytes": 1025, "max_bytes": 1024}


async def test_streamed_body_is_cut_off_at_the_limit(store: Path) -> None:
    sent: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        # No Content-Length (chunked): the server must stop reading once past the limit.
        for index in range(1000):
            sent.append(index)
            yield b"[" * 1024

    async with running(fake_app(store, max_body_bytes=4096)) as client:
        response = await client.post(
            "/v1/predict", content=chunks(), headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 413
    assert error_of(response)["code"] == "payload_too_large"
    assert len(sent) < 10


async def test_a_body_that_stops_arriving_gets_408(store: Path) -> None:
    stalled = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"inputs": [[0.1, '
        await stalled.wait()  # never set: the client stops sending mid-body
        yield b"0.2]]}"

    async with running(fake_app(store, body_timeout_s=0.2)) as client:
        response = await client.post(
            "/v1/predict", content=chunks(), headers={"Content-Type": "application/json"}
        )
        after = await client.post("/v1/predict", json={"inputs": X})
    assert response.status_code == 408
    error = error_of(response)
    assert error["code"] == "request_timeout" and error["detail"] == {"timeout_s": 0.2}
    assert after.status_code == 200


async def test_unknown_path_and_wrong_method(store: Path) -> None:
    async with running(fake_app(store)) as client:
        missing = await client.get("/v1/nowhere")  # /v2/* is the Open Inference Protocol's
        wrong = await client.get("/v1/predict")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    assert wrong.status_code == 405 and error_of(wrong)["code"] == "method_not_allowed"
    assert "POST" in wrong.headers["allow"]


async def test_api_key_is_required_except_on_the_probes(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = "s3cret-key-value"
    app = create_app(app_settings(store, api_key=key), pool_factory=fake_pool)
    async with running(app) as client:
        assert (await client.get("/healthz")).status_code == 200
        # A Kubernetes readiness probe cannot send the key (deploy/kuberay/raycluster.yaml).
        assert (await client.get("/readyz")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {key}"}):
            for method, path in (("GET", "/v1/model"), ("POST", "/v1/predict"),
                                 ("GET", "/metrics")):
                response = await client.request(method, path, json={"inputs": X}, headers=headers)
                assert response.status_code == 401, (headers, path)
                assert error_of(response)["code"] == "unauthorized"
                assert response.headers["www-authenticate"] == "Bearer"
        good = {"Authorization": f"Bearer {key}"}
        assert (await client.post("/v1/predict", json={"inputs": X}, headers=good)).is_success
        assert (await client.get("/v1/model", headers=good)).is_success
    assert key not in caplog.text


def _blocking_app(store: Path, **overrides: Any) -> tuple[FastAPI, list[BlockingPool]]:
    pools: list[BlockingPool] = []

    def factory(settings: Settings) -> ExpertPool:
        pools.append(BlockingPool(fake_pool(settings)))
        return pools[-1]

    return create_app(app_settings(store, **overrides), pool_factory=factory), pools


async def test_full_queue_is_429_with_retry_after(store: Path) -> None:
    app, pools = _blocking_app(store, max_queue_rows=4)
    async with running(app) as client:
        first = asyncio.create_task(
            client.post("/v1/predict", json={"inputs": np.zeros((4, 4)).tolist()})
        )
        await pools[0].entered.wait()
        refused = await client.post("/v1/predict", json={"inputs": X})
        pools[0].gate.set()
        assert (await first).status_code == 200
    assert refused.status_code == 429
    error = error_of(refused)
    assert error["code"] == "pool_saturated"
    assert int(refused.headers["retry-after"]) >= 1


async def test_no_answer_in_time_is_504(store: Path) -> None:
    app, pools = _blocking_app(store, request_timeout_s=0.01)
    async with running(app) as client:
        response = await client.post("/v1/predict", json={"inputs": X})
        pools[0].gate.set()
    assert response.status_code == 504
    assert error_of(response)["code"] == "timeout"


async def test_broken_expert_is_503_naming_it_while_others_serve(store: Path) -> None:
    m = manifest(store)
    x = np.random.default_rng(0).normal(size=(64, 4))
    async with running(fake_app(store)) as client:
        routed = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
        experts = [row[0] for row in routed["experts"]]
        broken, healthy = experts[0], next(e for e in experts if e != experts[0])
        path = store / m["experts"][broken]["file"]
        path.write_bytes(path.read_bytes()[:-8] + b"\x00" * 8)
        bad = await client.post("/v1/predict", json={"inputs": [x[0].tolist()]})
        row = x[experts.index(healthy)].tolist()
        good = await client.post("/v1/predict", json={"inputs": [row]})
    assert bad.status_code == 503
    error = error_of(bad)
    assert error["code"] == "expert_unavailable"
    assert error["detail"]["expert_id"] == broken
    assert str(broken) in error["message"]
    assert good.status_code == 200


async def test_a_missing_expert_file_is_503_naming_it_as_the_store_does_not_where_it_lies(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x = [X[0]]
    async with running(fake_app(store)) as client:
        expert = (await client.post("/v1/route", json={"inputs": x})).json()["experts"][0][0]
        name = manifest(store)["experts"][expert]["file"]  # experts/<id>-<hash>.safetensors
        (store / name).unlink()
        with caplog.at_level(logging.WARNING):
            response = await client.post("/v1/predict", json={"inputs": x})
    assert response.status_code == 503
    error = error_of(response)
    assert error["code"] == "expert_unavailable"
    assert error["detail"]["expert_id"] == expert
    for text in (error["message"], error["detail"]["reason"]):
        assert f"file missing: {name}" in text, text
    # The client is not told where the server keeps its stores; the server's log is.
    for root in {str(store), str(store.resolve())}:
        assert root not in response.text
    assert str(store / name) in caplog.text


async def test_unexpected_errors_are_a_logged_500_without_traceback(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(exploding_app(store)) as client:
        response = await client.post("/v1/predict", json={"inputs": X})
    assert response.status_code == 500
    error = error_of(response)
    error_id = error["detail"]["error_id"]
    assert error == {
        "code": "internal",
        "message": f"internal server error (error id {error_id} in the server's log)",
        "detail": {"error_id": error_id},
    }
    assert "secret internals" not in response.text
    # The log line with the traceback carries the id the client was given.
    [record] = [r for r in caplog.records if "secret internals" in r.exc_text or ""]
    assert record.getMessage().startswith(f"[error {error_id}] unhandled RuntimeError while "
                                          "serving /v1/predict")


def _overflowing_store(root: Path) -> Path:
    """Experts whose layers' weight matrices are scaled by 1e14: finite outputs for inputs
    near the prototypes (~1e28), float32 overflow for an input of 1e13 (finite, routable)."""
    from experts_store import ExpertArch, ExpertMLP, StoreWriter
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(0)
    with StoreWriter(root) as writer:
        for expert_id in range(4):
            expert = ExpertMLP(ExpertArch(widths=(4, 8, 2)), generator=generator)
            with torch.no_grad():
                for parameter in expert.parameters():
                    if parameter.dim() == 2:
                        parameter.mul_(1e14)
            writer.add_expert(expert_id, expert)
        prototypes = torch.randn(4, 4, generator=generator)
        PrototypeTree.build(prototypes, branching=2, seed=0).save(writer.router_path)
        writer.publish(task="regression", input_dim=4, output_dim=2, routing="tree", branching=2)
    return root


async def test_a_non_finite_output_is_422_naming_the_row_not_a_null(tmp_path: Path) -> None:
    # Finite inputs can overflow float32 inside an expert (or a hyper store's θ); the answer
    # must not be `null` in JSON (v1) or a bare NaN token (v2, not JSON at all), and a request
    # batched beside it keeps its answer.
    store = _overflowing_store(tmp_path / "big")
    rows = [[0.1, 0.2, 0.3, 0.4], [0.0, 0.1, 0.0, 0.1], [1e13] * 4]
    v2 = {"inputs": [{"name": "input", "shape": [3, 4], "datatype": "FP32",
                      "data": [v for row in rows for v in row]}]}
    async with running(fake_app(store)) as client:
        v1_answer, v2_answer, fine = await asyncio.gather(
            client.post("/v1/predict", json={"inputs": rows}),
            client.post(f"/v2/models/{store.name}/infer", json=v2),
            client.post("/v1/predict", json={"inputs": rows[:2]}),
        )
    assert v1_answer.status_code == 422, v1_answer.text
    error = error_of(v1_answer)
    assert error["code"] == "invalid_input" and "row 2" in error["message"]
    assert v2_answer.status_code == 400 and "row 2" in v2_answer.json()["error"]
    assert fine.status_code == 200
    assert all(all(abs(v) < 3.4e38 for v in row) for row in fine.json()["outputs"])


async def test_a_client_that_hangs_up_mid_body_is_no_server_error(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = fake_app(store)
    messages = [
        {"type": "http.request", "body": b'{"inputs": [[0.1, ', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/predict", "raw_path": b"/v1/predict", "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
    }
    async with running(app):
        await app(scope, receive, send)
        statuses = {
            status: app.state.metrics.sample(
                "momlp_requests_total", {"endpoint": "/v1/predict", "status": status}
            )
            for status in ("499", "500")
        }
    assert sent[0]["status"] == 499
    assert statuses == {"499": 1.0, "500": None}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_probes_answer_head_as_monitors_send_it(store: Path) -> None:
    async with running(fake_app(store)) as client:
        for path in ("/healthz", "/readyz"):
            answer = await client.head(path)
            assert answer.status_code == 200, (path, answer.text)


async def test_not_ready_while_no_actor_is_alive(store: Path) -> None:
    # DESIGN: readiness is "store loaded, pool up"; with every actor dead (restarting, or out
    # of restarts) nothing can be answered, and an orchestrator must see it.
    app = fake_app(store, actors=2)
    async with running(app) as client:
        pool = app.state.serving.pool
        pool._dispatcher.mark_dead("actor-0")
        half = await client.get("/readyz")
        pool._dispatcher.mark_dead("actor-1")
        none = await client.get("/readyz")
        metrics = (await client.get("/metrics")).text
        pool._dispatcher.mark_alive("actor-0")
        back = await client.get("/readyz")
    assert half.status_code == 200 and back.status_code == 200
    assert none.status_code == 503 and "no live actor" in error_of(none)["detail"]["reason"]
    assert 'momlp_actor_alive{actor="actor-0"} 0.0' in metrics
    assert 'momlp_actor_alive{actor="actor-1"} 0.0' in metrics


async def test_not_ready_before_startup(store: Path) -> None:
    app = fake_app(store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        ready = await client.get("/readyz")
        predict = await client.post("/v1/predict", json={"inputs": X})
        health = await client.get("/healthz")
    assert ready.status_code == 503 and error_of(ready)["code"] == "not_ready"
    assert predict.status_code == 503 and error_of(predict)["code"] == "not_ready"
    assert health.status_code == 200
