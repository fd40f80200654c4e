"""A request body's Content-Encoding: gzip, deflate or none.

tritonclient compresses a v2 request body when asked (`request_compression_algorithm="gzip"`
or `"deflate"`), as Triton's own HTTP endpoint accepts; the body's JSON header length
(`Inference-Header-Content-Length`) then counts the decoded bytes. /v1 bodies take the same
codings (an httpx client may send them too). The server's body limit holds for the decoded
bytes: a few kilobytes of gzip may stand for gigabytes.
"""

from __future__ import annotations

import zlib

from server._exceptions import HttpError

__all__ = ["decode_body"]

# zlib's window bits: 16 + 15 reads a gzip member, 15 a zlib stream (HTTP's "deflate").
_GZIP = 16 + zlib.MAX_WBITS
_WBITS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": zlib.MAX_WBITS}
_RAW_DEFLATE = -zlib.MAX_WBITS
# Bytes of a body handed to zlib at a time: the first slice of each gzip member, and the most.
_FIRST_FEED = 64
_MAX_FEED = 1 << 20


def decode_body(body: bytes, encoding: str | None, *, max_bytes: int) -> bytes:
    """`body` decoded as its Content-Encoding says: gzip, deflate or none (identity).

    413 when the decoded body exceeds `max_bytes` (detail `bytes`, `max_bytes` as every
    body-size 413, and `encoded_bytes`), 415 for another coding, 422 (answered as
    400 under /v2) for bytes that are not what the coding says.
    """
    if encoding is None:
        return body
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return body
    wbits = _WBITS.get(name)
    if wbits is None:
        raise HttpError(
            415,
            "unsupported_media_type",
            f"Content-Encoding {encoding[:64]!r} is not one of gzip, deflate or identity",
        )
    decoded = _inflate(body, wbits, max_bytes)
    if decoded is None and name == "deflate":
        # HTTP's "deflate" is the zlib format (tritonclient's), but some clients send the raw
        # deflate stream under that name.
        decoded = _inflate(body, _RAW_DEFLATE, max_bytes)
    if decoded is None:
        raise HttpError(422, "invalid_input", f"the request body is not valid {name} data")
    return decoded


def _inflate(body: bytes, wbits: int, max_bytes: int) -> bytes | None:
    """The whole stream decoded, or None when `body` is not complete streams of that format;
    never more than `max_bytes` + 1 bytes are produced.

    gzip may hold several members one after another (`cat a.gz b.gz`), which decode to their
    texts joined; each member is a stream of its own to zlib.
    """
    view = memoryview(body)
    parts: list[bytes] = []
    left, pos = max_bytes + 1, 0
    while True:
        inflater = zlib.decompressobj(wbits)
        # Fed in slices that double from `_FIRST_FEED`, never the whole rest: zlib copies the
        # bytes after a member's end into `unused_data`, so the rest handed to each member
        # made a body of n members O(n^2) (1.6 million 20-byte members fill the 32 MiB limit:
        # minutes of a core per request). Now a member costs at most twice its bytes, or a
        # first slice.
        feed = _FIRST_FEED
        while not inflater.eof:
            if pos >= len(view):
                return None  # the stream, or a member, ends early
            chunk = view[pos:pos + feed]
            pos += len(chunk)
            feed = min(2 * feed, _MAX_FEED)
            try:
                part = inflater.decompress(chunk, left)
            except zlib.error:
                return None
            if part:
                parts.append(part)
                left -= len(part)
            if left <= 0:
                # The keys of every other body-size 413 (`bytes`: as many as were read before
                # the limit stopped it), and the bytes the client sent beside them.
                raise HttpError(
                    413,
                    "payload_too_large",
                    f"the decoded body exceeds the limit of {max_bytes} bytes",
                    detail={
                        "bytes": max_bytes + 1 - left,
                        "max_bytes": max_bytes,
                        "encoded_bytes": len(body),
                    },
                )
        pos -= len(inflater.unused_data)
        if pos == len(view) or wbits != _GZIP:
            break
    if pos != len(view):
        return None  # bytes after a zlib or raw deflate stream
    return b"".join(parts)
