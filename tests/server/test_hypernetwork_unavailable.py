"""A hyper store whose hypernetwork f cannot be read: 503 naming f, on every endpoint; a hyper
store has no expert 0 or -1 for the message to name (it said "expert 0 cannot be served" for
a named condition on /v1, "expert -1" for a condition vector and on /v2)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from app_support import fake_app, running

from experts_store import ExpertChecksumError, Store
from server import ExpertUnavailable
from server.http import error_response
from trainer.hyper import HyperNetwork, PrimarySpec, publish_hypernetwork

pytestmark = pytest.mark.unit

M1, M2, OUT = 4, 5, 2


def _store_with_corrupt_f(root: Path) -> str:
    """A published hyper store whose f file no longer matches its checksum; f's file name."""
    torch.manual_seed(5)
    f = HyperNetwork(M2, PrimarySpec(M1, (8,), OUT), depth=1, width=32)
    publish_hypernetwork(root, f, conditions=torch.randn(2, M2), condition_ids=["a", "b"])
    spec = Store.open(root).manifest.hyper
    assert spec is not None
    name = spec.hypernetwork.file
    raw = bytearray((root / name).read_bytes())
    raw[-3] ^= 0xFF
    (root / name).write_bytes(bytes(raw))
    return name


def test_every_endpoint_names_the_hypernetwork_not_an_expert(tmp_path: Path) -> None:
    root = tmp_path / "store"
    name = _store_with_corrupt_f(root)
    x = np.zeros((1, M1), dtype=np.float32)
    rows = np.zeros((1, M1 + M2), dtype=np.float32)

    async def go() -> dict[str, httpx.Response]:
        async with running(fake_app(root)) as client:
            return {
                "v1 named condition": await client.post(
                    "/v1/predict", json={"inputs": x.tolist(), "condition_ids": ["a"]}
                ),
                "v1 condition vector": await client.post(
                    "/v1/predict", json={"inputs": x.tolist(), "condition": [0.5] * M2}
                ),
                "v1 generate": await client.post("/v1/generate", json={"condition_id": "b"}),
                "v2 infer": await client.post(f"/v2/models/{root.name}/infer", json={"inputs": [
                    {"name": "input", "shape": list(rows.shape), "datatype": "FP32",
                     "data": rows.reshape(-1).tolist()}]}),
            }

    for where, answer in asyncio.run(go()).items():
        assert answer.status_code == 503, (where, answer.text)
        body = answer.json()
        message = body["error"] if where.startswith("v2") else body["error"]["message"]
        assert message.startswith("no expert can be generated: "), (where, message)
        assert f"hypernetwork {name}: checksum mismatch" in message, (where, message)
        assert "expert 0" not in message and "expert -1" not in message, (where, message)
        if not where.startswith("v2"):
            error = body["error"]
            assert error["code"] == "expert_unavailable", where
            assert error["detail"]["hypernetwork"] == name, where


@pytest.mark.parametrize("path", ["/v1/predict", "/v2/models/m/infer"])
def test_a_hypernetwork_load_error_reaching_the_handler_names_the_hypernetwork(
    path: str,
) -> None:
    # The handler's own mapping of an ExpertLoadError: experts_store's reader stands in
    # expert id -1 for f, which it told as "expert -1 cannot be served".
    exc = ExpertChecksumError(expert_id=-1, expected="a" * 64, actual="b" * 64)
    answer = error_response(exc, path)
    assert answer.status_code == 503
    body = json.loads(bytes(answer.body))
    message = body["error"] if path.startswith("/v2") else body["error"]["message"]
    assert message.startswith("no expert can be generated: hypernetwork: checksum mismatch")
    assert "expert -1" not in message


def test_an_expert_s_own_failure_still_names_the_expert() -> None:
    reason = "expert 3: checksum mismatch (manifest sha256 aaaa..., file sha256 bbbb...)"
    unavailable = ExpertUnavailable(expert_id=3, reason=reason, node="hidden")
    assert unavailable.message == f"node 'hidden' expert 3 cannot be served: {reason}"
    assert unavailable.hypernetwork is None
    answer = error_response(
        ExpertChecksumError(expert_id=3, expected="a" * 64, actual="b" * 64), "/v1/predict"
    )
    assert json.loads(bytes(answer.body))["error"]["message"].startswith(
        "expert 3 cannot be served: expert 3: checksum mismatch"
    )
