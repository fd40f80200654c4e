"""Reading a request body: its headers, its size limits, its Content-Encoding, and the row
checks every body form shares.

The byte limit is checked on Content-Length first and then again while streaming, so a client
that lies about (or omits) the length is cut off at the limit instead of filling memory. The
forms of predict's and route's bodies (JSON, npy, raw float32) are parsed in `_forms`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeVar

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from server._exceptions import HttpError
from server.http._content_encoding import decode_body
from server.http._deadline import Deadline

__all__ = [
    "check_rows",
    "parse_encoded",
    "read_body_limited",
    "refuse_rows_beyond_scan",
    "require_json",
    "validation_detail",
]

JSON_TYPES = ("application/json",)
ROWS_HEADER = "x-momlp-rows"
_ROWS_NAME = ROWS_HEADER.encode("latin-1")
# Bodies above this are parsed in a worker thread so that the event loop keeps serving.
_THREAD_PARSE_BYTES = 256 * 1024
# JSON bodies above this are scanned for their arrays before the parse (a byte count: 12 ms
# for 33 MB): a parse holds the GIL, and 33 MB of short rows took 1.9 s of the whole server
# before its row count could be refused.
_SCAN_BYTES = 64 * 1024
_T = TypeVar("_T")


def refuse_rows_beyond_scan(
    body: bytes, separator: bytes, most: int, what: str, *, nested: bytes | None = None
) -> None:
    """413 before the parse when a large JSON body holds more `separator`s (the arrays or
    values of rows) than `most`, an upper bound of what any request within the caps holds.
    A body holding `nested` is malformed, not large: its parse refuses it at once (422)."""
    if len(body) > _SCAN_BYTES:
        found = body.count(separator)
        if found > most and (nested is None or nested not in body):
            raise _too_large(
                f"the body holds {found} {what}, more than any request within the limits "
                f"({most})",
                {what: found, "max": most},
            )


def _invalid(message: str, detail: Any = None) -> HttpError:
    return HttpError(422, "invalid_input", message, detail=detail)


def _too_large(message: str, detail: Any = None) -> HttpError:
    return HttpError(413, "payload_too_large", message, detail=detail)


def validation_detail(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic errors without the offending input (which may be megabytes) or doc URLs."""
    return [
        {"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]}
        for err in exc.errors(include_url=False, include_input=False, include_context=False)
    ][:20]


class _BodyHeaders(NamedTuple):
    media: str  # Content-Type without parameters, lower case
    length: str | None  # Content-Length as sent
    rows: str | None  # X-Momlp-Rows as sent
    encoding: str | None  # Content-Encoding as sent


def _body_headers(request: Request) -> _BodyHeaders:
    """The four headers a body's parse reads, in one pass over the raw headers (each
    `request.headers.get` scans them all again). The first of a repeated header wins, as with
    `request.headers.get`; ASGI servers give names in lower case."""
    media = length = rows = encoding = None
    for name, value in request.scope["headers"]:
        if name == b"content-type":
            media = value if media is None else media
        elif name == b"content-length":
            length = value if length is None else length
        elif name == _ROWS_NAME:
            rows = value if rows is None else rows
        elif name == b"content-encoding":
            encoding = value if encoding is None else encoding
    raw = "application/json" if media is None else media.decode("latin-1")
    return _BodyHeaders(
        raw.split(";", 1)[0].strip().lower(),
        None if length is None else length.decode("latin-1"),
        None if rows is None else rows.decode("latin-1"),
        None if encoding is None else encoding.decode("latin-1"),
    )


def require_json(request: Request) -> None:
    """415 unless the body is JSON (a missing Content-Type is taken as JSON, as predict's)."""
    media = _body_headers(request).media
    if media not in JSON_TYPES:
        raise HttpError(
            415, "unsupported_media_type", f"Content-Type {media!r} is not application/json"
        )


async def read_body_limited(
    request: Request,
    max_bytes: int,
    deadline: Deadline | None = None,
    *,
    declared: str | None | Literal[False] = False,
) -> bytes:
    """The whole body, refusing with 413 as soon as it is known to exceed `max_bytes`.

    A body not complete within `deadline` is refused with 408, so a client trickling its
    bytes cannot hold a connection (and its buffer) open for as long as it likes.
    `declared`: the Content-Length header when the caller has read it already.
    """
    if declared is False:
        declared = request.headers.get("content-length")
    if deadline is None:
        return await _read_body(request, max_bytes, declared)
    try:
        async with deadline.scope():
            return await _read_body(request, max_bytes, declared)
    except TimeoutError:
        raise HttpError(
            408,
            "request_timeout",
            f"the request body did not arrive within {deadline.timeout_s:g} s",
            detail={"timeout_s": deadline.timeout_s},
            headers={"Connection": "close"},
        ) from None


async def _read_body(request: Request, max_bytes: int, declared: str | None) -> bytes:
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise _invalid("Content-Length is not an integer") from None
        if length > max_bytes:
            raise _too_large(
                f"body of {length} bytes exceeds the limit of {max_bytes}",
                {"bytes": length, "max_bytes": max_bytes},
            )
    chunks: list[bytes] = []
    received = 0
    # The ASGI messages themselves, as `request.stream()` reads them, without its async
    # generator (a body of a few rows is one message).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        received += len(chunk)
        if received > max_bytes:
            raise _too_large(
                f"body exceeds the limit of {max_bytes} bytes",
                {"bytes": received, "max_bytes": max_bytes},
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def check_rows(rows: int, cols: int, *, max_rows: int, input_dim: int) -> None:
    """Refuse an empty batch, too many rows (413) or the wrong dimension (422)."""
    if rows > max_rows:
        raise _too_large(
            f"{rows} rows exceed the limit of {max_rows}", {"rows": rows, "max_rows": max_rows}
        )
    if rows < 1:
        raise _invalid("inputs must hold at least one row")
    if cols != input_dim:
        raise _invalid(
            f"inputs have dimension {cols}, the model expects {input_dim}",
            {"dimension": cols, "input_dim": input_dim},
        )


async def parse_encoded(
    body: bytes, encoding: str | None, parse: Callable[[bytes], _T], *, max_bytes: int
) -> _T:
    """`parse` of `body` decoded as its Content-Encoding says (none or identity: as it is).

    On the event loop when small (a thread hop costs more than parsing a few rows), in a
    worker thread when large, so the loop keeps serving; a compressed body always in the
    thread: its size says nothing of its decoded size (32 KB of gzip decode to 32 MiB in
    ~0.1 s), which `max_bytes` bounds (413).
    """
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return await run_in_threadpool(
            lambda: parse(decode_body(body, encoding, max_bytes=max_bytes))
        )
    if len(body) > _THREAD_PARSE_BYTES:
        return await run_in_threadpool(parse, body)
    return parse(body)
