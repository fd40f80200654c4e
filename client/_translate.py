"""Every failure httpx or the server hands the clients, translated into this package's tree.

A server's error answer (`{"error": {"code", "message", "detail"}}`, or whatever a proxy sent)
becomes the `HTTPStatusError` subclass of its status; an httpx exception becomes the
`TransportError` (or `DecodingError`, `ProtocolError`) that says what went wrong. The clients
raise only what these functions return, so that no raw httpx exception reaches a caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from ._exceptions import (
    ConnectError,
    ConnectTimeout,
    DecodingError,
    ExpertUnavailable,
    HTTPStatusError,
    InvalidInput,
    MomlpError,
    NetworkError,
    NotFound,
    PayloadTooLarge,
    ProtocolError,
    RateLimited,
    ServerError,
    ServiceUnavailable,
    TimeoutError,
    Unauthorized,
)

__all__ = ["TimeoutTypes", "has_request", "status_error", "transport_error"]

TimeoutTypes = float | httpx.Timeout | None

_STATUS_ERRORS: dict[int, type[HTTPStatusError]] = {
    401: Unauthorized,
    404: NotFound,
    413: PayloadTooLarge,
    422: InvalidInput,
    429: RateLimited,
    503: ServiceUnavailable,
}


def status_error(response: httpx.Response) -> HTTPStatusError:
    """The error for a non-2xx answer, with the server's code, message and detail when its body
    is the v1 error JSON, else the start of whatever text came back."""
    status = response.status_code
    code, message, detail = f"http_{status}", response.reason_phrase or "error", None
    try:
        error = response.json()["error"]
        code = str(error.get("code", code))
        message = str(error.get("message", message))
        detail = error.get("detail")
    except (ValueError, KeyError, TypeError, AttributeError, httpx.HTTPError):
        text = _safe_text(response)
        if text:
            message = text[:200]
    fields: dict[str, Any] = {
        "status_code": status,
        "code": code,
        "detail": detail,
        "url": str(response.request.url) if has_request(response) else "",
        "retry_after": _retry_after(response.headers.get("Retry-After")),
        "request_id": response.headers.get("X-Request-ID"),
    }
    if status == 503 and (code == "expert_unavailable" or _detail_expert(detail) is not None):
        reason = str(detail.get("reason", "")) if isinstance(detail, Mapping) else ""
        return ExpertUnavailable(
            message, expert_id=_detail_expert(detail), reason=reason, **fields
        )
    cls = _STATUS_ERRORS.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else HTTPStatusError
    return cls(message, **fields)


def transport_error(exc: Exception, url: str, timeout: TimeoutTypes = None) -> MomlpError:
    """The error for an httpx exception raised while sending to `url` ("METHOD /path")."""
    # httpx's async timeouts carry no text: say what ran out.
    text = str(exc) or (
        f"no answer within the timeout ({_timeout_text(timeout)})"
        if isinstance(exc, httpx.TimeoutException) else "(no detail)"
    )
    message = f"{url}: {type(exc).__name__}: {text}"
    if isinstance(exc, httpx.ConnectTimeout):
        return ConnectTimeout(message, url=url)
    if isinstance(exc, httpx.ConnectError):
        return ConnectError(message, url=url)
    if isinstance(exc, httpx.TimeoutException):
        return TimeoutError(message, url=url)
    if isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError):
        # RemoteProtocolError is how httpx reports a server that closed the connection before
        # or while answering: a broken connection, not malformed HTTP from this side.
        return NetworkError(message, url=url)
    if isinstance(exc, httpx.DecodingError):
        return DecodingError(message, url=url)
    return ProtocolError(message, url=url)


def has_request(response: httpx.Response) -> bool:
    """Whether `response.request` can be read (a response built by hand has none)."""
    try:
        _ = response.request
    except RuntimeError:
        return False
    return True


def _timeout_text(timeout: TimeoutTypes) -> str:
    if isinstance(timeout, httpx.Timeout):
        parts = {"connect": timeout.connect, "read": timeout.read, "write": timeout.write,
                 "pool": timeout.pool}
        return ", ".join(f"{name} {value:g} s" for name, value in parts.items() if value)
    return "none" if timeout is None else f"{timeout:g} s"


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        # An HTTP-date is legal too; without a wall clock to compare with, fall back to back-off.
        return None
    return seconds if seconds >= 0 else None


def _detail_expert(detail: Any) -> int | None:
    if isinstance(detail, Mapping) and isinstance(detail.get("expert_id"), int):
        return int(detail["expert_id"])
    return None


def _safe_text(response: httpx.Response) -> str:
    try:
        return response.text.strip()
    except (httpx.HTTPError, httpx.StreamError, UnicodeDecodeError):
        return ""
