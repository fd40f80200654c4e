"""A corrupted expert file is never served: the request answers 503 naming the expert."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from app_support import build_small_store, error_of, expert_outputs, fake_app, manifest, running

pytestmark = pytest.mark.unit


def flip_in_tensor_data(path: Path, where: str) -> None:
    """Flip one bit of the tensor data (past the safetensors header) at ``where``."""
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    start = 8 + header_len
    offset = {"first": start, "middle": (start + len(raw)) // 2, "last": len(raw) - 1}[where]
    raw[offset] ^= 0x04
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
async def test_a_flipped_byte_in_tensor_data_is_503_naming_the_expert(
    tmp_path: Path, where: str
) -> None:
    store = build_small_store(tmp_path / "store")
    x = np.random.default_rng(1).normal(size=(64, 4))
    async with running(fake_app(store)) as client:
        routed = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
        experts = [row[0] for row in routed["experts"]]
        broken = experts[0]
        healthy_row = next(i for i, e in enumerate(experts) if e != broken)
        healthy = experts[healthy_row]
        flip_in_tensor_data(store / manifest(store)["experts"][broken]["file"], where)
        answers = [
            await client.post("/v1/predict", json={"inputs": [x[0].tolist()]}) for _ in range(2)
        ]
        good = await client.post("/v1/predict", json={"inputs": [x[healthy_row].tolist()]})
    for bad in answers:
        assert bad.status_code == 503
        error = error_of(bad)
        assert error["code"] == "expert_unavailable"
        assert error["detail"]["expert_id"] == broken
        assert "checksum" in error["message"]
        # The pool remembers the bad file for 30 s (the default): the answer says when a
        # retry can succeed.
        assert 0 < error["detail"]["retry_after_s"] <= 30
        assert 1 <= int(bad.headers["Retry-After"]) <= 30
    assert good.status_code == 200
    assert good.json()["experts"] == [[healthy]]
    np.testing.assert_allclose(
        good.json()["outputs"],
        expert_outputs(store, healthy, x[healthy_row : healthy_row + 1]),
        rtol=1e-5,
        atol=1e-6,
    )
