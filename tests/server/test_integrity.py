"""A corrupted expert file is never served: the request answers 503 naming the expert."""

from __future__ import annotations

import struct
from pathlib import Path

import httpx
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


async def two_experts(client: httpx.AsyncClient, x: np.ndarray) -> tuple[int, int, int]:
    """Row 0's expert, then a row routed to another expert, and that expert."""
    routed = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
    experts = [row[0] for row in routed["experts"]]
    other = next(i for i, e in enumerate(experts) if e != experts[0])
    return experts[0], other, experts[other]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
async def test_a_flipped_byte_in_tensor_data_is_503_naming_the_expert(
    tmp_path: Path, where: str
) -> None:
    store = build_small_store(tmp_path / "store")
    x = np.random.default_rng(1).normal(size=(64, 4))
    async with running(fake_app(store)) as client:
        broken, healthy_row, healthy = await two_experts(client, x)
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


def poison_expert(store: Path, expert_id: int) -> None:
    """Expert `expert_id`'s first weight made NaN, and its manifest row (file name, sha256,
    fast checksum) rewritten to match, as a writer other than momlp's might: every checksum
    holds, so only a look at the weights tells."""
    import hashlib
    import json

    from experts_store._checksum import fast_checksum, new_fast_digest

    data = manifest(store)
    row = data["experts"][expert_id]
    raw = bytearray((store / row["file"]).read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_len : 12 + header_len] = struct.pack("<f", float("nan"))
    sha = hashlib.sha256(raw).hexdigest()
    fast = new_fast_digest()
    fast.update(bytes(raw))
    row.update(file=f"experts/{expert_id}-{sha[:16]}.safetensors", sha256=sha,
               checksum=fast_checksum(fast))
    (store / row["file"]).write_bytes(bytes(raw))
    (store / "manifest.json").write_text(json.dumps(data, indent=1))


async def test_an_expert_with_nan_weights_is_503_naming_it_not_the_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from server._cli import main

    store = build_small_store(tmp_path / "store")
    x = np.random.default_rng(1).normal(size=(64, 4))
    async with running(fake_app(store)) as client:
        poisoned, healthy_row, _ = await two_experts(client, x)
    poison_expert(store, poisoned)
    async with running(fake_app(store)) as client:
        bad = await client.post("/v1/predict", json={"inputs": [x[0].tolist()]})
        good = await client.post("/v1/predict", json={"inputs": [x[healthy_row].tolist()]})
    assert bad.status_code == 503, bad.text
    error = error_of(bad)
    assert error["code"] == "expert_unavailable"
    assert error["detail"]["expert_id"] == poisoned
    assert "its weights hold NaN or infinite values" in error["message"]
    assert good.status_code == 200
    # `momlp store verify` finds it too, though every checksum holds.
    assert main(["store", "verify", "--no-progress", str(store)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL expert {poisoned}: its weights hold NaN or infinite values" in out
