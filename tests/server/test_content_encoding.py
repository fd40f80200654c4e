"""A /v1 request body may come compressed (Content-Encoding gzip or deflate): it is served as
its decoded bytes, held to the body limit once decoded, and any other coding is refused; a body
labelled with a coding the server does not read was served as if it were plain."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from app_support import build_small_store, error_of, fake_app, running

pytestmark = pytest.mark.unit

MAX_BODY = 64 * 1024


def _rows(count: int, dim: int) -> np.ndarray:
    return np.random.default_rng(3).random((count, dim), dtype=np.float32)


async def test_a_compressed_predict_body_is_served_as_the_plain_one(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "s", K=8, n=4, out=2)
    x = _rows(5, 4)
    body = json.dumps({"inputs": x.tolist()}).encode()
    async with running(fake_app(store, max_body_bytes=MAX_BODY)) as client:
        plain = await client.post("/v1/predict", content=body,
                                  headers={"Content-Type": "application/json"})
        assert plain.status_code == 200, plain.text
        for coding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
            answer = await client.post(
                "/v1/predict", content=data,
                headers={"Content-Type": "application/json", "Content-Encoding": coding},
            )
            assert answer.status_code == 200, (coding, answer.text)
            assert answer.json()["outputs"] == plain.json()["outputs"]
        raw = await client.post(
            "/v1/predict", content=gzip.compress(x.tobytes()),
            headers={"Content-Type": "application/octet-stream", "X-Momlp-Rows": "5",
                     "Content-Encoding": "gzip", "Accept": "application/json"},
        )
        assert raw.status_code == 200, raw.text
        assert raw.json()["outputs"] == plain.json()["outputs"]


async def test_a_body_in_another_coding_or_past_the_limit_once_decoded_is_refused(
    tmp_path: Path,
) -> None:
    store = build_small_store(tmp_path / "s", K=8, n=4, out=2)
    body = json.dumps({"inputs": _rows(2, 4).tolist()}).encode()
    # A few hundred bytes on the wire that decode past the limit: refused, not inflated whole.
    bomb = gzip.compress(b" " * (MAX_BODY * 16) + body)
    assert len(bomb) < MAX_BODY // 8
    async with running(fake_app(store, max_body_bytes=MAX_BODY)) as client:
        headers = {"Content-Type": "application/json"}
        br = await client.post("/v1/predict", content=body,
                               headers={**headers, "Content-Encoding": "br"})
        assert br.status_code == 415 and error_of(br)["code"] == "unsupported_media_type"
        assert "'br'" in error_of(br)["message"]
        big = await client.post("/v1/predict", content=bomb,
                                headers={**headers, "Content-Encoding": "gzip"})
        assert big.status_code == 413 and error_of(big)["code"] == "payload_too_large"
        broken = await client.post("/v1/predict", content=gzip.compress(body)[:-9],
                                   headers={**headers, "Content-Encoding": "gzip"})
        assert broken.status_code == 422 and "not valid gzip" in error_of(broken)["message"]


async def test_a_body_past_the_limit_once_decoded_has_the_detail_of_a_plain_one(
    tmp_path: Path,
) -> None:
    # Its 413 said {"encoded_bytes", "max_bytes"}, where every other body-size 413 says
    # {"bytes", "max_bytes"}: a client reading `bytes` found none.
    store = build_small_store(tmp_path / "s", K=8, n=4, out=2)
    big = b" " * MAX_BODY + json.dumps({"inputs": _rows(2, 4).tolist()}).encode()
    json_type = {"Content-Type": "application/json"}
    async with running(fake_app(store, max_body_bytes=MAX_BODY)) as client:
        plain = await client.post("/v1/predict", content=big, headers=json_type)
        packed = {
            coding: (data, await client.post(
                "/v1/predict", content=data, headers={**json_type, "Content-Encoding": coding}
            ))
            for coding, data in (("gzip", gzip.compress(big)), ("deflate", zlib.compress(big)))
        }
    assert plain.status_code == 413, plain.text
    assert error_of(plain)["detail"] == {"bytes": len(big), "max_bytes": MAX_BODY}
    for coding, (data, answer) in packed.items():
        assert answer.status_code == 413, (coding, answer.text)
        assert error_of(answer)["code"] == "payload_too_large"
        # The bytes decoded when the limit stopped the decoding, as a streamed body's count.
        assert error_of(answer)["detail"] == {
            "bytes": MAX_BODY + 1, "max_bytes": MAX_BODY, "encoded_bytes": len(data)
        }, coding


async def test_a_compressed_generate_body_is_served_as_the_plain_one(tmp_path: Path) -> None:
    from trainer.hyper import HyperNetwork, PrimarySpec, publish_hypernetwork

    torch.manual_seed(0)
    f = HyperNetwork(5, PrimarySpec(4, (8,), 2), depth=1, width=32)
    table = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    publish_hypernetwork(tmp_path / "h", f, conditions=table, condition_ids=["a", "b", "c"])
    body = json.dumps({"condition": table[1].tolist()}).encode()
    async with running(fake_app(tmp_path / "h", max_body_bytes=MAX_BODY)) as client:
        headers = {"Content-Type": "application/json"}
        plain = await client.post("/v1/generate", content=body, headers=headers)
        assert plain.status_code == 200, plain.text
        packed = await client.post("/v1/generate", content=gzip.compress(body),
                                   headers={**headers, "Content-Encoding": "gzip"})
        assert packed.status_code == 200, packed.text
        assert packed.content == plain.content
        br = await client.post("/v1/generate", content=body,
                               headers={**headers, "Content-Encoding": "br"})
        assert br.status_code == 415


async def test_a_compressed_generate_body_is_decoded_while_other_requests_are_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /v1/generate decoded on the event loop: 32 KB of gzip that decode to the 32 MiB limit
    # held every request of the server for ~0.1 s, on any store kind (the kind is checked
    # after the parse). Here the decode waits until /healthz has been answered meanwhile.
    from server.http._content_encoding import decode_body

    started, answered = threading.Event(), threading.Event()
    waited: list[bool] = []

    def decode_when_answered(body: bytes, encoding: str | None, *, max_bytes: int) -> bytes:
        started.set()
        waited.append(answered.wait(5.0))  # on the loop, nothing else runs meanwhile
        return decode_body(body, encoding, max_bytes=max_bytes)

    monkeypatch.setattr("server.http._body.decode_body", decode_when_answered)
    store = build_small_store(tmp_path / "s", K=8, n=4, out=2)
    body = gzip.compress(json.dumps({"condition_id": "a"}).encode())
    # The default limit: a body that may decode to 32 MiB.
    async with running(fake_app(store, max_body_bytes=32 * 1024 * 1024)) as client:
        generate = asyncio.ensure_future(client.post(
            "/v1/generate", content=body,
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        ))
        while not started.is_set() and not generate.done():
            await asyncio.sleep(0.01)
        health = await client.get("/healthz")
        answered.set()
        refused = await generate
    assert health.status_code == 200
    assert waited == [True]
    assert refused.status_code == 404  # a momlp store generates nothing; decoded all the same


async def test_a_gzip_body_of_several_members_is_their_texts_joined(tmp_path: Path) -> None:
    # `cat a.gz b.gz` is one gzip body (RFC 1952): it was refused as "not valid gzip data".
    store = build_small_store(tmp_path / "s", K=8, n=4, out=2)
    body = json.dumps({"inputs": _rows(3, 4).tolist()}).encode()
    half = len(body) // 2
    members = gzip.compress(body[:half]) + gzip.compress(body[half:])
    async with running(fake_app(store, max_body_bytes=MAX_BODY)) as client:
        headers = {"Content-Type": "application/json"}
        plain = await client.post("/v1/predict", content=body, headers=headers)
        joined = await client.post("/v1/predict", content=members,
                                   headers={**headers, "Content-Encoding": "gzip"})
        assert joined.status_code == 200, joined.text
        assert joined.json()["outputs"] == plain.json()["outputs"]
        # Trailing bytes that are no member are still refused, and so is a deflate body with
        # bytes after its stream (a zlib stream has no members).
        junk = await client.post("/v1/predict", content=gzip.compress(body) + b"junk",
                                 headers={**headers, "Content-Encoding": "gzip"})
        assert junk.status_code == 422
        extra = await client.post("/v1/predict", content=zlib.compress(body) * 2,
                                  headers={**headers, "Content-Encoding": "deflate"})
        assert extra.status_code == 422
