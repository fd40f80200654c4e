"""The Open Inference Protocol v2 endpoint as tritonclient meets it: a real uvicorn on loopback
(the in-process pool), every store kind, and what Triton's own client sends beyond the basics
(compressed bodies, class_count, repeated outputs), each answered as asked or refused in the
protocol's shape, never served as something else."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from app_support import build_small_store, fake_app
from uvicorn_support import serving_in_thread

pytestmark = pytest.mark.unit

triton = pytest.importorskip("tritonclient.http")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException

OUTPUTS = ("output", "experts", "weights")
MAX_BODY = 64 * 1024


@dataclass(frozen=True)
class Served:
    url: str
    model: str
    input_dim: int
    condition_dim: int  # hyper: the trailing columns of a v2 row are its condition

    def client(self) -> Any:
        return triton.InferenceServerClient(url=self.url.removeprefix("http://"))

    def rows(self, count: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).random((count, self.input_dim), dtype=np.float32)

    def v1_predict(self, x: np.ndarray) -> dict[str, Any]:
        """/v1/predict on the same rows (a hyper row's condition as `conditions`)."""
        split = self.input_dim - self.condition_dim
        body: dict[str, Any] = {"inputs": x[:, :split].tolist()}
        if self.condition_dim:
            body["conditions"] = x[:, split:].tolist()
        answer = httpx.post(f"{self.url}/v1/predict", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()
        return result


def _store(kind: str, root: Path) -> tuple[Path, int]:
    """A small store of `kind` and its condition width (0 but for hyper)."""
    if kind == "momlp":
        return build_small_store(root / "mystore", K=8, n=4, out=2), 0
    if kind == "graph":
        from graph_support import tiny_graph_store

        tiny_graph_store(root / "gstore")
        return root / "gstore", 0
    if kind == "hyper":
        from trainer.hyper import HyperNetwork, PrimarySpec, publish_hypernetwork

        torch.manual_seed(0)
        f = HyperNetwork(5, PrimarySpec(4, (8,), 2), depth=1, width=32)
        table = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
        publish_hypernetwork(root / "hstore", f, conditions=table, condition_ids=["a", "b", "c"])
        return root / "hstore", 5
    from experts_store import ImageLayout
    from trainer.pmoe import PatchMoE, publish_pmoe

    image = ImageLayout(height=6, width=4, channels=2, patch_height=3, patch_width=2)
    model = PatchMoE(
        num_patches=image.num_patches, patch_dim=image.patch_dim, num_experts=3,
        patches_per_expert=2, hidden=5, num_classes=3, gating="softmax",
        router_init_std=1.0, expert_init_std=0.5, seed=0,
    )
    publish_pmoe(model, root / "pstore", train="joint", image=image)
    return root / "pstore", 0


@pytest.fixture(scope="module", params=["momlp", "graph", "hyper", "pmoe"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    Served
]:
    store, condition_dim = _store(request.param, tmp_path_factory.mktemp(request.param))
    # device named: a module fixture runs before the conftest's per-test MOMLP_DEVICE=cpu.
    app = fake_app(store, device="cpu", max_rows=64, max_body_bytes=MAX_BODY)
    with serving_in_thread(app, "momlp-v2-tritonclient") as url:
        client = triton.InferenceServerClient(url=url.removeprefix("http://"))
        dim = client.get_model_metadata(store.name)["inputs"][0]["shape"][1]
        client.close()
        yield Served(url, store.name, dim, condition_dim)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [True, False])
def test_a_compressed_request_is_served_and_equals_v1(
    served: Served, algorithm: str, binary: bool
) -> None:
    # tritonclient's request_compression_algorithm, which Triton serves: each was a 400
    # "the inference request does not match the protocol".
    x = served.rows(5, seed=1)
    expected = served.v1_predict(x)
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [triton.InferRequestedOutput(name, binary_data=binary) for name in OUTPUTS]
    client = served.client()
    try:
        result = client.infer(
            served.model, [tensor], outputs=wanted, request_id="zipped",
            request_compression_algorithm=algorithm,
        )
    finally:
        client.close()
    assert result.get_response()["id"] == "zipped"
    np.testing.assert_array_equal(
        result.as_numpy("output"), np.asarray(expected["outputs"], np.float32)
    )
    experts = result.as_numpy("experts")
    assert experts.shape[0] == 5 and experts.dtype == np.int64
    if served.condition_dim == 0:  # a hyper row has no expert (-1 here, [] in /v1)
        np.testing.assert_array_equal(experts, np.asarray(expected["experts"]))


def test_a_compressed_body_is_held_to_the_body_limit_once_decoded(served: Served) -> None:
    # Zeros compress a thousandfold: within the limit on the wire, far beyond it decoded.
    rows = 64
    cols = MAX_BODY // (rows * 4) + served.input_dim
    tensor = triton.InferInput("input", [rows, cols], "FP32")
    tensor.set_data_from_numpy(np.zeros((rows, cols), np.float32))
    client = served.client()
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(served.model, [tensor], request_compression_algorithm="gzip")
    finally:
        client.close()
    assert refused.value.status() == "413"
    assert f"decoded body exceeds the limit of {MAX_BODY}" in refused.value.message()


def test_an_unknown_or_broken_encoding_is_refused_in_the_protocols_shape(
    served: Served,
) -> None:
    x = served.rows(2, seed=2)
    body = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()
    infer = f"{served.url}/v2/models/{served.model}/infer"
    brotli = httpx.post(infer, content=body, headers={"Content-Encoding": "br"})
    truncated = httpx.post(
        infer, content=gzip.compress(body)[:-8], headers={"Content-Encoding": "gzip"}
    )
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw = raw_deflate.compress(body) + raw_deflate.flush()
    deflated = httpx.post(infer, content=raw, headers={"Content-Encoding": "deflate"})
    assert brotli.status_code == 415 and "br" in brotli.json()["error"]
    assert truncated.status_code == 400
    assert truncated.json() == {"error": "the request body is not valid gzip data"}
    assert deflated.status_code == 200, deflated.text  # raw deflate under "deflate" too


def test_class_count_is_refused_not_answered_with_raw_scores(served: Served) -> None:
    # The classification extension is not served: the raw float output came back under the
    # same name, where the client asked for the top classes.
    x = served.rows(3, seed=3)
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    client = served.client()
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(
                served.model, [tensor], outputs=[triton.InferRequestedOutput("output",
                                                                             class_count=2)]
            )
    finally:
        client.close()
    assert refused.value.status() == "400"
    assert "classification extension (class_count)" in refused.value.message()


def test_shared_memory_is_refused_by_name(served: Served) -> None:
    # An input in a shared-memory region was "neither data nor binary_data_size"; an output
    # asked into one came back in the body while the client read its region.
    x = served.rows(2, seed=7)
    in_region = triton.InferInput("input", list(x.shape), "FP32")
    in_region.set_shared_memory("rows", x.nbytes)
    in_body = triton.InferInput("input", list(x.shape), "FP32")
    in_body.set_data_from_numpy(x)
    out_region = triton.InferRequestedOutput("output")
    out_region.set_shared_memory("outputs", 64)
    client = served.client()
    try:
        with pytest.raises(InferenceServerException) as by_input:
            client.infer(served.model, [in_region])
        with pytest.raises(InferenceServerException) as by_output:
            client.infer(served.model, [in_body], outputs=[out_region])
    finally:
        client.close()
    assert by_input.value.status() == by_output.value.status() == "400"
    assert by_input.value.message().startswith("input 'input' asks for shared memory")
    assert by_output.value.message().startswith("output 'output' asks for shared memory")


def test_an_output_asked_twice_is_refused_and_an_empty_list_answers_all(
    served: Served,
) -> None:
    x = served.rows(3, seed=4)
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    twice = [triton.InferRequestedOutput("output"),
             triton.InferRequestedOutput("output", binary_data=False)]
    client = served.client()
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(served.model, [tensor], outputs=twice)
    finally:
        client.close()
    assert refused.value.status() == "400"
    assert "'output' is requested more than once" in refused.value.message()
    # An empty list names no output: every output, as Triton answers it (it was none at all).
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}], "outputs": []}
    answer = httpx.post(f"{served.url}/v2/models/{served.model}/infer", json=body)
    assert answer.status_code == 200, answer.text
    assert [o["name"] for o in answer.json()["outputs"]] == list(OUTPUTS)
    np.testing.assert_array_equal(
        np.asarray(answer.json()["outputs"][0]["data"], np.float32).reshape(3, -1),
        np.asarray(served.v1_predict(x)["outputs"], np.float32),
    )


def test_binary_bytes_no_input_claims_are_refused_not_ignored(served: Served) -> None:
    x = served.rows(2, seed=5)
    zeros = np.zeros_like(x)
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32",
              "data": zeros.ravel().tolist()}
    infer = f"{served.url}/v2/models/{served.model}/infer"

    def post(header: dict[str, Any]) -> httpx.Response:
        head = json.dumps(header).encode()
        return httpx.post(infer, content=head + x.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(head))})

    # The rows x follow the header, but the input says its data are the zeros in the JSON:
    # the zeros were served.
    unclaimed = post({"inputs": [tensor]})
    both = post({"inputs": [{**tensor, "parameters": {"binary_data_size": x.nbytes}}]})
    assert unclaimed.status_code == 400
    assert "follow the JSON header, but the input has no binary_data_size" in (
        unclaimed.json()["error"]
    )
    assert both.status_code == 400
    assert both.json() == {"error": "the input has both data and binary_data_size: send one "
                           "of them"}


def test_an_unknown_model_is_named_without_a_version_nobody_asked_for(served: Served) -> None:
    x = served.rows(2, seed=6)
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    client = served.client()
    try:
        with pytest.raises(InferenceServerException) as unversioned:
            client.infer("no-such-model", [tensor])
        with pytest.raises(InferenceServerException) as versioned:
            client.infer("no-such-model", [tensor], model_version="3")
    finally:
        client.close()
    assert unversioned.value.status() == "404"
    assert unversioned.value.message() == "unknown model 'no-such-model'"
    assert versioned.value.message() == "unknown model 'no-such-model' (version '3')"
