"""`RequestIdMiddleware`: every answer carries an `X-Request-ID`, the caller's or a new one.

A caller (or the proxy in front) that sends `X-Request-ID` gets the same id back, so one id
follows a request through every hop's logs; one that sends none, or one unfit for a log line
(over 128 characters, or anything but visible ASCII), gets a fresh id. A 500's `error_id` and
its log line use the same id (`server.http._errors`); `RequestIdLogFilter` puts it at the end of
uvicorn's access log line, so a 503 or 504 a user reports is found too.
"""

from __future__ import annotations

import logging
import secrets
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "MAX_REQUEST_ID",
    "REQUEST_ID_HEADER",
    "RequestIdLogFilter",
    "RequestIdMiddleware",
    "current_request_id",
]

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128

_HEADER = REQUEST_ID_HEADER.encode("latin-1")
# The id of the request whose task is running: the error handlers and uvicorn's access line
# (written from the `send` the app awaits) run inside that task.
_CURRENT: ContextVar[str | None] = ContextVar("momlp_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request being answered in this task, or None outside one."""
    return _CURRENT.get()


class RequestIdLogFilter(logging.Filter):
    """Ends each record logged while a request is answered with `[request <id>]`."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = _CURRENT.get()
        if request is not None and isinstance(record.args, tuple):
            record.msg = f"{record.msg} [request %s]"
            record.args = (*record.args, request)
        return True


def _usable(raw: bytes) -> bool:
    # Visible ASCII only: the id goes into log lines as it came, where a space or a control
    # character could forge or split a line.
    return 0 < len(raw) <= MAX_REQUEST_ID and all(0x21 <= byte <= 0x7E for byte in raw)


def _incoming(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == _HEADER:
            return value if _usable(value) else None
    return None


class RequestIdMiddleware:
    """Gives each HTTP request an id (`current_request_id()`) and puts it on the answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = _incoming(scope) or secrets.token_hex(8).encode("ascii")
        text = raw.decode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", ())
                    if name.lower() != _HEADER
                ]
                headers.append((_HEADER, raw))
                message = {**message, "headers": headers}
            await send(message)

        token = _CURRENT.set(text)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _CURRENT.reset(token)
