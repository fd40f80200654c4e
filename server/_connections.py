"""The HTTP connections uvicorn holds for the server: a deadline for each request's headers,
and a cap on how many are open at once.

uvicorn times an idle connection out only after a response (its keep-alive timeout, which any
byte received cancels), and the app bounds a body only once it reads it (`body_timeout_s`).
A client that opened connections and never finished their headers held each one for good: an
audit held 20,800 until the process ran out of file descriptors and refused everyone
(benchmarks/RESULTS.md, "Sixtieth session"). Here a connection whose request headers have not
all arrived `header_timeout_s` after it opened, or after its previous response, is closed, and
one opened while `max_connections` are open is closed at once, before anything is read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # The attributes and hooks used below are those of both of uvicorn's HTTP/1.1 protocols
    # (httptools and h11); the class is built on whichever uvicorn picks (`guarded_protocol`).
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
else:
    _Base = asyncio.Protocol

__all__ = ["CloseReason", "ClosedConnectionLog", "guarded_protocol"]

logger = logging.getLogger(__name__)

CloseReason = str
"""Why a connection was closed unasked: "header_timeout" or "over_limit"."""


class _Guard(_Base):
    header_timeout_s: float
    max_connections: int
    on_close: Callable[[CloseReason], None]

    _header_timer: asyncio.TimerHandle | None = None
    _waiting_since: object = None

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
        super().connection_lost(exc)

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
    base: type[asyncio.Protocol] | None = None,
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class (`base`, default the one uvicorn would pick) with the
    header deadline and the connection cap; `on_close` hears of each connection they close."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    namespace: dict[str, Any] = {
        "header_timeout_s": header_timeout_s,
        "max_connections": max_connections,
        "on_close": staticmethod(on_close),
    }
    return type(f"Guarded{base.__name__}", (_Guard, base), namespace)


class ClosedConnectionLog:
    """Logs the connections closed unasked at most once a minute per reason (a flood closes
    thousands a second), with how many since the last line; `count` hears of each one."""

    _WHY = {
        "header_timeout": "their request headers did not all arrive within {timeout:g} s",
        "over_limit": "they were opened while {cap} connections were open",
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
        why = self._WHY.get(reason, reason).format(timeout=self._timeout, cap=self._cap)
        logger.warning(
            "closed %s connection%s because %s%s",
            closed,
            "" if closed == 1 else "s",
            why,
            "" if last is None else f" (in the last {now - last:.0f} s)",
        )
