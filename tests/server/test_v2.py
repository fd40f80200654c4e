"""The Open Inference Protocol v2 endpoints over the in-process pool: shapes, the binary
extension by hand, errors in the protocol's shape, and the traps its clients set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from app_support import build_small_store, expert_outputs, fake_app, running

pytestmark = pytest.mark.unit

N = 4


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return build_small_store(tmp_path / "mystore", K=8, n=N, out=2)


def infer_body(x: np.ndarray, **extra: object) -> dict[str, object]:
    return {
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": "FP32",
                "data": x.ravel().tolist(),
            }
        ],
        **extra,
    }


async def test_health_metadata_and_json_infer_match_v1(store: Path) -> None:
    x = np.random.default_rng(0).normal(size=(5, N)).astype(np.float32)
    async with running(fake_app(store)) as client:
        assert (await client.get("/v2/health/live")).json() == {"live": True}
        assert (await client.get("/v2/health/ready")).json() == {"ready": True}
        assert (await client.get("/v2/models/mystore/ready")).json() == {"ready": True}
        meta = (await client.get("/v2/models/mystore")).json()
        v1 = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
        answer = await client.post("/v2/models/mystore/infer", json=infer_body(x, id="r1"))
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, N]}]
    assert [o["name"] for o in meta["outputs"]] == ["output", "experts", "weights"]
    assert meta["versions"] == [v1["store_version"]]
    body = answer.json()
    assert body["id"] == "r1" and body["model_name"] == "mystore"
    outputs = {o["name"]: o for o in body["outputs"]}
    assert outputs["output"]["shape"] == [5, 2] and outputs["output"]["datatype"] == "FP32"
    np.testing.assert_allclose(
        np.asarray(outputs["output"]["data"]).reshape(5, 2), v1["outputs"], rtol=1e-6
    )
    experts = np.asarray(outputs["experts"]["data"]).reshape(5, 1)
    np.testing.assert_array_equal(experts, v1["experts"])
    expected = np.stack(
        [expert_outputs(store, int(e), x[i : i + 1])[0] for i, e in enumerate(experts[:, 0])]
    )
    np.testing.assert_allclose(np.asarray(v1["outputs"]), expected, rtol=1e-5, atol=1e-6)
    assert body["parameters"]["store_version"] == v1["store_version"]


async def test_binary_tensor_data_in_and_out(store: Path) -> None:
    x = np.random.default_rng(1).normal(size=(3, N))  # float64, sent as FP64
    header = {
        "inputs": [
            {"name": "input", "shape": [3, N], "datatype": "FP64",
             "parameters": {"binary_data_size": x.nbytes}}
        ],
        "outputs": [
            {"name": "output", "parameters": {"binary_data": True}},
            {"name": "experts"},
        ],
    }
    head = json.dumps(header).encode()
    async with running(fake_app(store)) as client:
        v1 = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
        # No Content-Type at all, as tritonclient's sync client may send.
        answer = await client.post(
            "/v2/models/mystore/infer",
            content=head + x.astype("<f8").tobytes(),
            headers={"Inference-Header-Content-Length": str(len(head))},
        )
    assert answer.status_code == 200, answer.text
    length = int(answer.headers["inference-header-content-length"])
    described = json.loads(answer.content[:length])
    output, experts = described["outputs"]
    assert output["parameters"]["binary_data_size"] == 3 * 2 * 4 and "data" not in output
    got = np.frombuffer(answer.content[length:], dtype="<f4").reshape(3, 2)
    np.testing.assert_allclose(got, v1["outputs"], rtol=1e-6)
    assert experts["data"] == np.asarray(v1["experts"]).ravel().tolist()


async def test_clients_extra_fields_are_ignored_and_parameters_set_top_k(store: Path) -> None:
    x = np.random.default_rng(2).normal(size=(2, N)).astype(np.float32)
    body = infer_body(x, model_name="mystore", parameters={"top_k": 3, "mode": "exact"})
    body["inputs"][0]["parameters"] = {"content_type": "np"}  # type: ignore[index]
    async with running(fake_app(store)) as client:
        answer = await client.post("/v2/models/mystore/infer", json=body)
        v1 = await client.post(
            "/v1/predict", json={"inputs": x.tolist(), "top_k": 3, "mode": "exact"}
        )
    outputs = {o["name"]: o for o in answer.json()["outputs"]}
    assert outputs["experts"]["shape"] == [2, 3]
    np.testing.assert_allclose(
        np.asarray(outputs["weights"]["data"]).reshape(2, 3), v1.json()["weights"], rtol=1e-6
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v2/models/other/infer", None, 404, "unknown model"),
        # A version a hot swap replaced: the model is there and says which version it serves.
        ("/v2/models/mystore/versions/0-gone/infer", None, 404, "has no version '0-gone'"),
        ("/v2/models/mystore/infer", "no-inputs", 400, "does not match"),
        ("/v2/models/mystore/infer", "wrong-dim", 400, f"expects {N}"),
        ("/v2/models/mystore/infer", "nan", 400, "finite"),
        ("/v2/models/mystore/infer", "top_k", 400, "top_k"),
        ("/v2/models/mystore/infer", "too-many", 413, "rows"),
        ("/v2/models/mystore/infer", "bad-output", 400, "unknown output"),
        ("/v2/no/such/path", None, 404, "not found"),
    ],
)
async def test_errors_are_the_protocols_shape(
    store: Path, path: str, body: object, status: int, words: str
) -> None:
    x = np.zeros((2, N), np.float32)
    payload: object = {
        None: infer_body(x),
        "wrong-dim": infer_body(np.zeros((2, N + 1), np.float32)),
        "nan": infer_body(x),
        "top_k": infer_body(x, parameters={"top_k": 99}),
        "too-many": infer_body(np.zeros((9, N), np.float32)),
        "bad-output": infer_body(x, outputs=[{"name": "logits"}]),
        "no-inputs": {"inputs": []},
    }[body]  # type: ignore[index]
    content = json.dumps(payload)
    if body == "nan":
        content = content.replace("0.0", "NaN", 1)
    async with running(fake_app(store, max_rows=8)) as client:
        answer = await client.post(path, content=content)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert isinstance(error, str) and words in error.lower()


async def test_the_key_guards_v2_like_v1(store: Path) -> None:
    async with running(fake_app(store, api_key="s3cret")) as client:
        # The probes stay open (an orchestrator's probe cannot send the key).
        assert (await client.get("/v2/health/live")).status_code == 200
        assert (await client.get("/v2/health/ready")).status_code == 200
        refused = await client.get("/v2/models/mystore")
        allowed = await client.get("/v2/models/mystore", headers={"Authorization": "Bearer s3cret"})
    assert refused.status_code == 401 and isinstance(refused.json()["error"], str)
    assert allowed.status_code == 200


@pytest.mark.parametrize(
    ("name", "edit", "words"),
    [
        # Each must be a 400 in the protocol's shape; every one of them was a bare 500 (or a
        # 200 answering something else) before.
        ("temperature nan string", {"parameters": {"temperature": "nan"}}, "finite"),
        ("temperature inf string", {"parameters": {"temperature": "inf"}}, "finite"),
        ("temperature NaN token", {"parameters": {"temperature": "@NaN"}}, "finite"),
        ("temperature -Infinity token", {"parameters": {"temperature": "@-Infinity"}}, "finite"),
        ("temperature 1e400", {"parameters": {"temperature": "@1e400"}}, "finite"),
        ("top_k not a number", {"parameters": {"top_k": "abc"}}, "integer"),
        ("top_k a fraction", {"parameters": {"top_k": 1.5}}, "integer"),
        ("top_k 400 digits", {"parameters": {"top_k": "@" + "9" * 400}}, "top_k"),
        ("data 400 digits", {"data": "@" + "9" * 400}, "numbers"),
        ("data strings", {"data": ["1", "2", "3", "4", "5", "6", "7", "8"]}, "numbers"),
        ("data booleans", {"data": [True] * 8}, "numbers"),
        # Mixed in with numbers, numpy casts them to 1.0 and 0.0.
        ("data a boolean among floats", {"data": [0.5, True, 0.25, 0, 0, 0, 0, 0]}, "numbers"),
        ("data a boolean among ints", {"data": [1, 2, 3, False, 0, 0, 0, 0]}, "numbers"),
        ("data a boolean in nested rows", {"data": [[0.5, 1, 2, 3], [4, 5, 6, True]]}, "numbers"),
        ("temperature zero", {"parameters": {"temperature": 0}}, "temperature must be > 0"),
        ("temperature negative", {"parameters": {"temperature": "-1"}}, "must be > 0"),
        ("top_k zero", {"parameters": {"top_k": 0}}, "top_k must be >= 1"),
        ("min_weight one", {"parameters": {"min_weight": 1}}, "min_weight must be in [0, 1)"),
        ("top_p zero", {"parameters": {"top_p": 0.0}}, "top_p must be in (0, 1]"),
        ("binary flag a string", {"parameters": {"binary_data_output": "yes"}}, "true or false"),
    ],
)
async def test_bad_numbers_and_flags_are_400s_not_500s(
    store: Path, name: str, edit: dict[str, object], words: str
) -> None:
    body = infer_body(np.zeros((2, N), np.float32))
    tensor = body["inputs"][0]  # type: ignore[index]
    tokens: dict[str, str] = {}
    for key, value in edit.items():
        if key == "data":
            tensor[key] = value  # type: ignore[index]
            if isinstance(value, str):
                tensor[key] = [value, 0, 0, 0, 0, 0, 0, 0]  # type: ignore[index]
            continue
        body[key] = value
    # "@..." marks a value written into the JSON text as it is (NaN, 400 digits).
    content = json.dumps(body)
    for marked in _marked(body):
        tokens[json.dumps(marked)] = marked[1:]
    for quoted, raw in tokens.items():
        content = content.replace(quoted, raw)
    async with running(fake_app(store)) as client:
        answer = await client.post("/v2/models/mystore/infer", content=content)
        again = await client.post(
            "/v2/models/mystore/infer", json=infer_body(np.zeros((2, N), np.float32))
        )
    assert answer.status_code == 400, (name, answer.text)
    error = answer.json()["error"]
    assert isinstance(error, str) and words in error.lower(), (name, error)
    assert again.status_code == 200  # the connection and the server serve on


def _marked(node: object) -> list[str]:
    if isinstance(node, str):
        return [node] if node.startswith("@") else []
    if isinstance(node, dict):
        return [m for value in node.values() for m in _marked(value)]
    if isinstance(node, list):
        return [m for value in node for m in _marked(value)]
    return []


async def test_a_string_binary_data_size_is_named(store: Path) -> None:
    x = np.zeros((2, N), np.float32)
    header = {"inputs": [{"name": "input", "shape": [2, N], "datatype": "FP32",
                          "parameters": {"binary_data_size": str(x.nbytes)}}]}
    head = json.dumps(header).encode()
    async with running(fake_app(store)) as client:
        answer = await client.post(
            "/v2/models/mystore/infer", content=head + x.tobytes(),
            headers={"Inference-Header-Content-Length": str(len(head))},
        )
    assert answer.status_code == 400
    assert "binary_data_size must be an integer" in answer.json()["error"]


async def test_a_binary_flag_false_as_text_answers_json(store: Path) -> None:
    x = np.zeros((2, N), np.float32)
    async with running(fake_app(store)) as client:
        answer = await client.post(
            "/v2/models/mystore/infer",
            json=infer_body(x, parameters={"binary_data_output": "false"}),
        )
    assert answer.status_code == 200
    assert "inference-header-content-length" not in answer.headers
    assert [o["name"] for o in answer.json()["outputs"]] == ["output", "experts", "weights"]


async def test_an_unknown_output_is_refused_before_any_work(store: Path) -> None:
    x = np.zeros((2, N), np.float32)
    app = fake_app(store)
    async with running(app) as client:
        answer = await client.post(
            "/v2/models/mystore/infer", json=infer_body(x, outputs=[{"name": "logits"}])
        )
        rows = app.state.metrics.sample("momlp_rows_total")
    assert answer.status_code == 400 and "unknown output" in answer.json()["error"]
    assert rows == 0.0
