"""The HTTP connections uvicorn holds for the server: a deadline for each request's headers,
a bound on their size, and a cap on how many are open at once.

uvicorn times an idle connection out only after a response (its keep-alive timeout, which any
byte received cancels), and the app bounds a body only once it reads it (`body_timeout_s`).
A client that opened connections and never finished their headers held each one for good: an
audit held 20,800 until the process ran out of file descriptors and refused everyone
(benchmarks/RESULTS.md, "Sixtieth session"). Here a connection whose request headers have not
all arrived `header_timeout_s` after it opened, or after its previous response, is closed, and
one opened while `max_connections` are open is closed at once, before anything is read.

uvicorn's httptools protocol (the one it picks when httptools is installed, as here) bounds
neither the size nor the count of a request's headers (its h11 protocol refuses past 16 KiB):
one connection sent 8.9 million header lines in 4 s and grew the process by 1.1 GB, and
200 connections holding 60,000 unfinished header lines each held 0.7 GB. Here a request line
and headers beyond `MAX_HEADER_BYTES`, or more than `MAX_HEADER_FIELDS` header lines, are
answered 431 and the connection is closed; a chunked body's trailer lines count with its
headers (one unfinished trailer line grew the process by 100 MB in 8 s); past the bound the
connection is closed, with a 431 only where the request's own answer is complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # The attributes and hooks used below are those of both of uvicorn's HTTP/1.1 protocols
    # (httptools and h11); the class is built on whichever uvicorn picks (`guarded_protocol`).
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
else:
    _Base = asyncio.Protocol

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_HEADER_FIELDS",
    "CloseReason",
    "ClosedConnectionLog",
    "guarded_protocol",
]

logger = logging.getLogger(__name__)

CloseReason = str
"""Why a connection was closed unasked: "header_timeout", "over_limit" or
"headers_too_large"."""

# As nginx's default large_client_header_buffers hold (4 x 8 KiB) twice over, and Apache's
# LimitRequestFields: far above what any client of this API sends (a bearer key, a request
# id, tritonclient's few headers), far below what costs the process anything.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 100
# After a 431 the connection still takes (and drops) what the client was sending for this
# long before it closes: closed at once with unread bytes, it is reset, and a client still
# sending may lose the answer.
_LINGER_S = 1.0


def _headers_too_large_answer() -> bytes:
    body = json.dumps(
        {
            "error": {
                "code": "headers_too_large",
                "message": f"the request line and headers exceed {MAX_HEADER_BYTES} bytes or "
                f"{MAX_HEADER_FIELDS} header lines",
                "detail": {
                    "max_header_bytes": MAX_HEADER_BYTES,
                    "max_header_fields": MAX_HEADER_FIELDS,
                },
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"x-request-id: {secrets.token_hex(8)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _Guard(_Base):
    header_timeout_s: float
    max_connections: int
    on_close: Callable[[CloseReason], None]
    on_lost: Callable[[Mapping[str, object]], None]
    # Whether the base is httptools' protocol, whose parser callbacks the header bound hooks.
    bound_headers: bool

    _header_timer: asyncio.TimerHandle | None = None
    _waiting_since: object = None
    # Bytes received, header lines and the url and header bytes parsed, since the request
    # whose headers are awaited began; None while a request's body arrives (from its headers'
    # end, and from each chunk's data: see `on_chunk_header`).
    _header_bytes: int | None = 0
    _header_fields = 0
    _header_parsed = 0
    _refused = False
    # httptools: the cycles a pipelined request's cycle replaced as `self.cycle` before they
    # were answered, oldest first; the first of them is still awaited, and `self.cycle` alone
    # missed it. (h11 reads no request before the one before it is answered: `self.cycle` is
    # the only one there.)
    _earlier: tuple[Any, ...] = ()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            # Closed before a byte is read: its descriptor is free again at once.
            self.on_close("over_limit")
            transport.close()
            return
        self._expect_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._expect_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        current = self.cycle
        earlier, self._earlier = self._earlier, ()
        for cycle in (*earlier, current):
            if cycle is None or cycle.response_complete:
                continue
            if cycle is not current:
                # uvicorn marks only the current cycle disconnected: an earlier one would
                # write its answer into the closed transport (and log it as sent).
                cycle.disconnected = True
                cycle.message_event.set()
            # A request whose answer is still awaited: stopped now (499), not computed or
            # retried for no one (uvicorn itself only marks the cycle disconnected). A
            # pipelined request not started yet awaits nothing: a no-op.
            self.on_lost(cycle.scope)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered 431: what the client still sends is dropped unread
        if not self.bound_headers:
            super().data_received(data)
            return
        if self._header_bytes is not None:
            self._header_bytes += len(data)
        super().data_received(data)
        # A header line still incomplete is held by the parser, not yet reported: counted in
        # bytes received. What this chunk holds past a request's headers is not counted.
        awaited = self._header_bytes
        if self._refused or (awaited is not None and awaited > MAX_HEADER_BYTES):
            self._refuse_headers()

    # httptools' parser callbacks, called only when `bound_headers`.
    def on_url(self, url: bytes) -> None:
        self._header_parsed += len(url)
        if self._header_parsed <= MAX_HEADER_BYTES:
            super().on_url(url)
        else:
            self._refused = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_fields += 1
        self._header_parsed += len(name) + len(value)
        if self._header_fields <= MAX_HEADER_FIELDS and self._header_parsed <= MAX_HEADER_BYTES:
            super().on_header(name, value)
        else:
            self._refused = True  # and the line is not kept

    def on_headers_complete(self) -> None:
        self._header_bytes = None
        if not self._refused:
            previous = self.cycle
            super().on_headers_complete()
            if previous is None or previous is self.cycle:
                return
            if not previous.response_complete:
                # Pipelined: `previous` is still answered, or waits its turn, behind this one.
                self._earlier = (*self._earlier, previous)
            elif self._earlier:
                self._earlier = ()  # answered in order: all are, once the latest one is

    def on_chunk_header(self) -> None:
        # After the last chunk's size line come trailer lines, which httptools holds as it
        # holds header lines, unbounded until one ends: one that never ended grew the process
        # for as long as the body was awaited. From each size line until its chunk's data,
        # bytes received count again (the size lines themselves are never held).
        self._header_bytes = 0

    def on_body(self, body: bytes) -> None:
        self._header_bytes = None  # a chunk's data: body, not trailer
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        # The next request's headers begin; bytes of this chunk past this point are not
        # counted, at most one read's worth.
        self._header_bytes = 0
        self._header_fields = self._header_parsed = 0

    def _refuse_headers(self) -> None:
        """Answer 431 and close, when the client ends its side or after `_LINGER_S`."""
        self._refused = True
        self._stop_waiting()
        if self.transport.is_closing():
            return
        self.on_close("headers_too_large")
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A pipelined request's answer is being written: a 431 would land inside it.
            self.transport.close()
            return
        self.transport.write(_headers_too_large_answer())
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then the end
        self.loop.call_later(_LINGER_S, self.transport.close)

    def _expect_headers(self) -> None:
        """From now on the next request's headers have `header_timeout_s` to arrive."""
        self._stop_waiting()
        if self.transport.is_closing():
            return
        # uvicorn starts a new cycle for each request once its headers are complete.
        self._waiting_since = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_waiting(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        cycle = self.cycle
        if cycle is not self._waiting_since:
            return  # a request's headers came; its response re-arms the deadline
        if cycle is not None and not cycle.response_complete:
            return  # a pipelined request is still being answered
        if not self.transport.is_closing():
            self.on_close("header_timeout")
            self.transport.close()


def guarded_protocol(
    *,
    header_timeout_s: float,
    max_connections: int,
    on_close: Callable[[CloseReason], None] = lambda _reason: None,
    on_lost: Callable[[Mapping[str, object]], None] = lambda _scope: None,
    base: type[asyncio.Protocol] | None = None,
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class (`base`, default the one uvicorn would pick) with the
    header deadline, the bound on headers and the connection cap; `on_close` hears of each
    connection they close, `on_lost` of each lost while its request was not yet answered
    (with that request's ASGI scope)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    namespace: dict[str, Any] = {
        "header_timeout_s": header_timeout_s,
        "max_connections": max_connections,
        "on_close": staticmethod(on_close),
        "on_lost": staticmethod(on_lost),
        # h11's parser bounds a request's headers itself (16 KiB, answered 400).
        "bound_headers": hasattr(base, "on_headers_complete"),
    }
    return type(f"Guarded{base.__name__}", (_Guard, base), namespace)


class ClosedConnectionLog:
    """Logs the connections closed unasked at most once a minute per reason (a flood closes
    thousands a second), with how many since the last line; `count` hears of each one."""

    _WHY = {
        "header_timeout": "their request headers did not all arrive within {timeout:g} s",
        "over_limit": "they were opened while {cap} connections were open",
        "headers_too_large": "their request line and headers (or a chunked body's trailer"
        " lines) exceeded {max_bytes} bytes or {max_fields} lines (answered 431 where no"
        " answer of theirs was pending)",
    }

    def __init__(
        self,
        *,
        header_timeout_s: float,
        max_connections: int,
        count: Callable[[CloseReason], None] = lambda _reason: None,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._timeout = header_timeout_s
        self._cap = max_connections
        self._count = count
        self._every_s = every_s
        self._clock = clock
        self._last: dict[CloseReason, float] = {}
        self._unlogged: dict[CloseReason, int] = {}

    def __call__(self, reason: CloseReason) -> None:
        self._count(reason)
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        now = self._clock()
        last = self._last.get(reason)
        if last is not None and now - last < self._every_s:
            return
        self._last[reason] = now
        closed = self._unlogged.pop(reason)
        why = self._WHY.get(reason, reason).format(
            timeout=self._timeout,
            cap=self._cap,
            max_bytes=MAX_HEADER_BYTES,
            max_fields=MAX_HEADER_FIELDS,
        )
        logger.warning(
            "closed %s connection%s because %s%s",
            closed,
            "" if closed == 1 else "s",
            why,
            "" if last is None else f" (in the last {now - last:.0f} s)",
        )
