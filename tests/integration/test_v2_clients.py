"""Open Inference Protocol v2 through clients nobody here wrote: tritonclient (JSON and
binary tensor data) and the generated open-inference-openapi client, against a real
`momlp serve` (embedded Ray, two actors). Their outputs equal `/v1/predict`'s on the same
rows."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_support import OUT, K, N, ServeProcess, build_store, serve_process

pytestmark = [pytest.mark.integration, pytest.mark.ray]

MODEL = "store"  # the store directory's name


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("v2")
    store = build_store(tmp / MODEL)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    args = ["--store", str(store), "--port", "0", "--actors", "2", "--ray-num-cpus", "2"]
    with serve_process(args, env=env, cwd=tmp) as process:
        yield process


def rows(seed: int, count: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, N)).astype(np.float32)


def v1_predict(url: str, x: np.ndarray, top_k: int = 1) -> dict[str, np.ndarray]:
    body = {"inputs": x.tolist(), "mode": "exact", "top_k": top_k}
    answer = httpx.post(f"{url}/v1/predict", json=body, timeout=30).json()
    return {key: np.asarray(answer[key]) for key in ("outputs", "experts", "weights")}


def test_tritonclient_health_metadata_and_infer_in_json_and_binary(served: ServeProcess) -> None:
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    client = triton.InferenceServerClient(url=served.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL)
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, N]}]
    assert meta["outputs"][0] == {"name": "output", "datatype": "FP32", "shape": [-1, OUT]}
    server = client.get_server_metadata()
    assert server["name"] == "momlp" and "binary_tensor_data" in server["extensions"]

    x = rows(0)
    expected = v1_predict(served.url, x, top_k=2)
    for binary in (False, True):
        tensor = triton.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        wanted = [
            triton.InferRequestedOutput(name, binary_data=binary)
            for name in ("output", "experts", "weights")
        ]
        result = client.infer(
            MODEL, [tensor], outputs=wanted, parameters={"mode": "exact", "top_k": 2}
        )
        np.testing.assert_allclose(result.as_numpy("output"), expected["outputs"], rtol=1e-6)
        np.testing.assert_array_equal(result.as_numpy("experts"), expected["experts"])
        np.testing.assert_allclose(result.as_numpy("weights"), expected["weights"], rtol=1e-6)
        assert result.get_response()["parameters"]["vram_bytes"] > 0

    # tritonclient's defaults: binary input, no outputs named (so all come back binary).
    x64 = rows(1).astype(np.float64)
    tensor = triton.InferInput("input", list(x64.shape), "FP64")
    tensor.set_data_from_numpy(x64)
    result = client.infer(MODEL, [tensor], parameters={"mode": "exact"})
    expected = v1_predict(served.url, x64.astype(np.float32))
    np.testing.assert_allclose(result.as_numpy("output"), expected["outputs"], rtol=1e-6)

    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("no-such-model", [tensor])
    bad = triton.InferInput("input", [2, N + 1], "FP32")
    bad.set_data_from_numpy(np.zeros((2, N + 1), np.float32))
    with pytest.raises(InferenceServerException, match=f"expects {N}"):
        client.infer(MODEL, [bad])
    client.close()


def test_the_open_inference_openapi_client(served: ServeProcess) -> None:
    from open_inference.openapi.client import OpenInferenceClient
    from open_inference.openapi.types import InferenceRequest, RequestInput

    http = httpx.Client(timeout=60.0)
    client = OpenInferenceClient(base_url=served.url, httpx_client=http)
    client.check_server_liveness()
    client.check_server_readiness()
    client.check_model_readiness(MODEL)
    assert client.read_server_metadata().name == "momlp"
    meta = client.read_model_metadata(MODEL)
    assert meta.name == MODEL and meta.inputs[0].shape == [-1, N]
    x = rows(2)
    request = InferenceRequest(
        inputs=[
            RequestInput(name="input", shape=list(x.shape), datatype="FP32", data=x.tolist())
        ],
        parameters={"mode": "exact"},
    )
    answer = client.model_infer(MODEL, request=request)
    outputs = {out.name: out for out in answer.outputs}
    assert outputs["output"].shape == [x.shape[0], OUT]
    got = np.asarray(json.loads(outputs["output"].data.json()), dtype=np.float32)
    np.testing.assert_allclose(
        got.reshape(x.shape[0], OUT), v1_predict(served.url, x)["outputs"], rtol=1e-6
    )
    experts = np.asarray(json.loads(outputs["experts"].data.json()))
    assert experts.shape == (x.shape[0],) and experts.min() >= 0 and experts.max() < K
    http.close()


def test_v2_model_under_a_configured_name(tmp_path: Path) -> None:
    """`--model-name`-less servers use the directory name; MOMLP_MODEL_NAME renames it."""
    store = build_store(tmp_path / "some-dir")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOMLP_MODEL_NAME": "ackley"}
    env.pop("RAY_ADDRESS", None)
    args = ["--store", str(store), "--port", "0", "--actors", "1", "--ray-num-cpus", "1"]
    with serve_process(args, env=env, cwd=tmp_path) as process:
        assert httpx.get(f"{process.url}/v2/models/ackley/ready").status_code == 200
        missing = httpx.get(f"{process.url}/v2/models/some-dir")
        assert missing.status_code == 404 and isinstance(missing.json()["error"], str)
