"""The server's HTTP connections under real uvicorn on loopback: slow headers and too many
connections are closed, requests that take their time are not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import httpx
import pytest
from app_support import build_small_store, fake_app
from loopback_support import serving
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server._connections import (
    MAX_HEADER_BYTES,
    MAX_HEADER_FIELDS,
    ClosedConnectionLog,
)
from server._runner import connection_cap
from server._settings import Settings

pytestmark = pytest.mark.unit

PROTOCOLS = [pytest.param(HttpToolsProtocol, id="httptools"), pytest.param(H11Protocol, id="h11")]


async def _slow_hello(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http":
        await asyncio.sleep(float(scope["path"].strip("/") or 0))
        await PlainTextResponse("hello")(scope, receive, send)


async def _closed_after(reader: asyncio.StreamReader, within_s: float) -> float:
    """Seconds until the server closed the connection (EOF), failing past `within_s`."""
    start = time.monotonic()
    data = await asyncio.wait_for(reader.read(), timeout=within_s)
    assert data == b""  # closed without an answer
    return time.monotonic() - start


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    base: type[asyncio.Protocol],
) -> None:
    async with serving(_slow_hello, base, header_timeout_s=0.3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        waited = await _closed_after(reader, within_s=5.0)
        writer.close()
    assert 0.25 <= waited < 3.0


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_headers_trickling_in_are_cut_off_at_the_deadline_after_a_response_too(
    base: type[asyncio.Protocol],
) -> None:
    async with serving(_slow_hello, base, header_timeout_s=0.5) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"hello"), timeout=5.0)
        assert head.startswith(b"HTTP/1.1 200")
        # The next request's headers, a byte every 0.1 s: each byte would restart uvicorn's
        # own keep-alive timer, but not the deadline.
        start = time.monotonic()
        closed = False
        for byte in b"GET / HTTP/1.1\r\nx-slow: " + b"a" * 100:
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            if reader.at_eof() or (await _eof_within(reader, 0.1)):
                closed = True
                break
        waited = time.monotonic() - start
        writer.close()
    assert closed
    assert 0.4 <= waited < 3.0


async def _eof_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), timeout=seconds) == b""
    except TimeoutError:
        return False


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_requests_slower_than_the_header_timeout_are_answered_pipelined_too(
    base: type[asyncio.Protocol],
) -> None:
    async with serving(_slow_hello, base, header_timeout_s=0.3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Two pipelined requests that each take twice the header timeout to answer.
        writer.write(b"GET /0.6 HTTP/1.1\r\nhost: x\r\n\r\nGET /0.6 HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        first = await asyncio.wait_for(reader.readuntil(b"hello"), timeout=5.0)
        second = await asyncio.wait_for(reader.readuntil(b"hello"), timeout=5.0)
        writer.close()
    assert first.startswith(b"HTTP/1.1 200")
    assert second.lstrip().startswith(b"HTTP/1.1 200")


async def test_connections_beyond_the_cap_are_closed_unread_and_counted(tmp_path: Path) -> None:
    app = fake_app(build_small_store(tmp_path / "store"))
    async with app.router.lifespan_context(app):  # the app's own metrics, as momlp serve has
        async with serving(app, header_timeout_s=30.0, max_connections=3) as port:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await _closed_after(reader, within_s=2.0) < 1.0
            writer.close()
            for _, w in held[:2]:
                assert not w.is_closing()
            # One of the three goes away: a new client gets in and is answered.
            held[0][1].close()
            await held[0][1].wait_closed()
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"http://127.0.0.1:{port}/metrics")
            for _, w in held[1:]:
                w.close()
    assert answer.status_code == 200
    assert 'momlp_connections_closed_total{reason="over_limit"} 1.0' in answer.text


async def test_a_header_timeout_is_counted_in_the_metrics(tmp_path: Path) -> None:
    app = fake_app(build_small_store(tmp_path / "store"))
    async with app.router.lifespan_context(app):
        async with serving(app, header_timeout_s=0.2) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await _closed_after(reader, within_s=5.0)
            writer.close()
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert 'momlp_connections_closed_total{reason="header_timeout"} 1.0' in answer.text


_GET = b"GET /healthz HTTP/1.1\r\nhost: x\r\n"


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(_GET + b"x-big: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n", id="long-header"),
        pytest.param(_GET + b"a: b\r\n" * (MAX_HEADER_FIELDS + 1) + b"\r\n", id="many-lines"),
        pytest.param(
            b"GET /healthz?q=" + b"a" * MAX_HEADER_BYTES + b" HTTP/1.1\r\nhost: x\r\n\r\n",
            id="long-query",
        ),
        # Never finished: held until the header timeout, growing the process all along.
        pytest.param(_GET + b"a:\r\n" * 50_000, id="unfinished"),
    ],
)
async def test_request_headers_beyond_the_bound_get_431_and_others_are_served(
    tmp_path: Path, head: bytes
) -> None:
    # httptools (what uvicorn picks here) bounds neither: one connection's 8.9 million
    # header lines took 1.1 GB of the process, and the request was then served.
    app = fake_app(build_small_store(tmp_path / "store"))
    async with app.router.lifespan_context(app):
        async with serving(app, header_timeout_s=30.0) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), timeout=10.0)
            writer.close()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                other = await client.get("/healthz")
                metrics = await client.get("/metrics")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "headers_too_large"
    assert error["detail"] == {
        "max_header_bytes": MAX_HEADER_BYTES, "max_header_fields": MAX_HEADER_FIELDS
    }
    assert other.status_code == 200
    assert 'momlp_connections_closed_total{reason="headers_too_large"} 1.0' in metrics.text


async def test_headers_within_the_bound_are_served_however_they_arrive(tmp_path: Path) -> None:
    app = fake_app(build_small_store(tmp_path / "store"))
    head = (
        b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"x-pad: " + b"p" * (MAX_HEADER_BYTES - 4096) + b"\r\n"
        + b"a: b\r\n" * (MAX_HEADER_FIELDS - 4)
    )
    body = b'{"inputs": [[0.1, 0.2, 0.3, 0.4]]}'
    request = head + b"content-length: %d\r\n\r\n" % len(body) + body
    async with app.router.lifespan_context(app):
        async with serving(app, header_timeout_s=30.0) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answers = []
            # Three on one connection: in pieces of 1000 bytes, then whole, twice.
            for pieces in ([request[i : i + 1000] for i in range(0, len(request), 1000)],
                           [request], [request]):
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                answers.append(await asyncio.wait_for(_response(reader), timeout=10.0))
            writer.close()
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers


async def _body_length(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, however long it takes (no body deadline), and answers its length."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    await PlainTextResponse(str(size))(scope, receive, send)


_CHUNKED = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_a_trailer_line_that_never_ends_is_cut_off_at_the_header_bound(
    base: type[asyncio.Protocol],
) -> None:
    # httptools holds an unfinished trailer line as it holds a header line: the bytes after
    # a chunked body's last chunk were not counted, and one line that never ended grew the
    # process (100 MB in 8 s) for as long as the app awaited the body's end.
    async with serving(_body_length, base, header_timeout_s=30.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_CHUNKED + b"5\r\nhello\r\n0\r\nx-trailer: ")
            # Past the bound, several times over; the server may close while it is sent.
            with contextlib.suppress(ConnectionError):
                for _ in range(4 * MAX_HEADER_BYTES // 4096):
                    writer.write(b"a" * 4096)
                    await writer.drain()
            try:
                answer = await asyncio.wait_for(reader.read(), timeout=10.0)
                closed = True
            except TimeoutError:
                answer, closed = b"", False  # still held open, the line still growing
            except ConnectionError:
                answer, closed = b"", True
        finally:
            writer.close()
    assert closed
    assert b" 200 " not in answer


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_a_chunked_body_with_trailers_within_the_bound_is_served(
    base: type[asyncio.Protocol],
) -> None:
    # Chunk size lines end reads of their own: the byte count that restarts at each one must
    # not add up a long body's data.
    data = b"x" * 1000
    chunks = [b"%x\r\n" % len(data), data + b"\r\n"] * 300
    trailer = b"0\r\nx-checksum: " + b"c" * (MAX_HEADER_BYTES // 2) + b"\r\n\r\n"
    async with serving(_body_length, base, header_timeout_s=30.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for _ in range(2):  # the count restarts for the next request on the connection
            writer.write(_CHUNKED)
            for piece in chunks:
                writer.write(piece)
                await writer.drain()
            writer.write(trailer)
            await writer.drain()
            answers.append(await asyncio.wait_for(_response(reader), timeout=10.0))
        writer.close()
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert answer.endswith(b"\r\n\r\n%d" % (300 * len(data)))


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One response with a Content-Length, read whole."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.partition(b":")[2])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


def test_the_cap_is_lowered_to_half_the_descriptor_limit() -> None:
    assert connection_cap(4096, nofile=lambda: 1024) == 512
    assert connection_cap(4096, nofile=lambda: 20000) == 4096
    assert connection_cap(100, nofile=lambda: 0) == 100  # no limit known


@pytest.mark.parametrize(
    ("name", "value"), [("header_timeout_s", 0.0), ("max_connections", 0)]
)
def test_settings_refuse_a_header_timeout_or_cap_that_would_refuse_everyone(
    name: str, value: float
) -> None:
    with pytest.raises(ValueError, match=name):
        Settings(**{name: value})


def test_closed_connections_are_logged_at_most_once_a_minute_per_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    counted: list[str] = []
    log = ClosedConnectionLog(
        header_timeout_s=10, max_connections=3, count=counted.append, clock=lambda: now[0]
    )
    with caplog.at_level(logging.WARNING, logger="server._connections"):
        log("over_limit")
        for _ in range(499):
            now[0] += 0.1
            log("over_limit")
        log("header_timeout")
        now[0] = 61.0
        log("over_limit")
    lines = [r.getMessage() for r in caplog.records]
    assert counted.count("over_limit") == 501 and counted.count("header_timeout") == 1
    assert lines == [
        "closed 1 connection because they were opened while 3 connections were open",
        "closed 1 connection because their request headers did not all arrive within 10 s",
        "closed 500 connections because they were opened while 3 connections were open"
        " (in the last 61 s)",
    ]
