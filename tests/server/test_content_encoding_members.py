"""A gzip body of several members (server/http/_content_encoding.py): decoded to their texts
joined, at a cost that grows with the body, not with its square."""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Any

import pytest

from server._exceptions import HttpError
from server.http._content_encoding import decode_body

pytestmark = pytest.mark.unit

LIMIT = 32 * 1024 * 1024


class _Counted:
    """zlib's decompressor, counting the bytes handed to it and copied back out of it."""

    handled = 0

    def __init__(self, wbits: int) -> None:
        self._inner = _REAL(wbits)

    def decompress(self, data: Any, max_length: int = 0) -> bytes:
        _Counted.handled += len(data)
        return self._inner.decompress(data, max_length)

    @property
    def eof(self) -> bool:
        return self._inner.eof

    @property
    def unused_data(self) -> bytes:
        unused = self._inner.unused_data
        _Counted.handled += len(unused)
        return unused

    @property
    def unconsumed_tail(self) -> bytes:
        return self._inner.unconsumed_tail


_REAL = zlib.decompressobj


def test_a_body_of_many_small_members_costs_in_proportion_to_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each member was handed the whole rest of the body, which zlib copied back out after the
    # member's end: 20,000 empty members (400 KB) handled ~8 GB, and the 32 MiB limit's worth
    # of them (1.6 million) held a core for minutes per request.
    body = gzip.compress(b"") * 20_000
    monkeypatch.setattr(zlib, "decompressobj", _Counted)
    _Counted.handled = 0
    assert decode_body(body, "gzip", max_bytes=LIMIT) == b""
    assert _Counted.handled <= 8 * len(body)


@pytest.mark.parametrize(
    "texts",
    [
        [b"a"],
        [b'{"inputs": [[1, 2]]}'] * 3,
        [b"", b"x" * 100_000, b""],
        [os.urandom(3 << 20), b"tail"],  # a member over the largest slice, stored uncompressed
        [bytes(range(256)) * 50] * 40,
    ],
    ids=["one", "three", "empty-around-large", "incompressible", "forty"],
)
def test_members_decode_to_their_texts_joined(texts: list[bytes]) -> None:
    body = b"".join(gzip.compress(t) for t in texts)
    assert decode_body(body, "gzip", max_bytes=LIMIT) == b"".join(texts)
    # Whatever the slices, a body cut short or followed by bytes that are no member is refused.
    for bad in (body[:-1], body + b"\x00", body + b"junk"):
        with pytest.raises(HttpError) as refused:
            decode_body(bad, "gzip", max_bytes=LIMIT)
        assert refused.value.status == 422


def test_deflate_streams_stay_single_and_bounded() -> None:
    text = os.urandom(2 << 20)
    assert decode_body(zlib.compress(text), "deflate", max_bytes=LIMIT) == text
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode_body(raw.compress(text) + raw.flush(), "deflate", max_bytes=LIMIT) == text
    with pytest.raises(HttpError) as twice:
        decode_body(zlib.compress(text) * 2, "deflate", max_bytes=LIMIT)
    assert twice.value.status == 422
    # Past the limit across members: 413, having produced no more than the limit and a byte.
    with pytest.raises(HttpError) as big:
        decode_body(gzip.compress(b" " * 600) * 2, "gzip", max_bytes=1000)
    assert big.value.status == 413
