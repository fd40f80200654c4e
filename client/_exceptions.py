"""Every error the client raises on purpose; no raw httpx exception ever escapes.

MomlpError
 ├── InputError              refused before sending: inputs not a 2-D finite numeric array, or
 │                           an option (top_k, mode, gate, conditions) of the wrong type
 ├── ClientClosed            a call on a closed client (also a RuntimeError, as httpx's was)
 ├── LoadTestConfigError     a load test setting refused (setting, value); also a ValueError
 ├── DecodingError           a 2xx response that does not match the v1 JSON contract
 ├── TransportError          the request did not get an HTTP answer
 │    ├── ConnectError        could not connect (retried)
 │    │    └── ConnectTimeout  connecting timed out (retried; also a TimeoutError)
 │    ├── TimeoutError        no answer in time (read, write or pool wait)
 │    ├── NetworkError        the connection broke while sending or reading
 │    └── ProtocolError       malformed HTTP, bad URL, redirects, misuse of a stream
 └── HTTPStatusError         an HTTP answer with a non-2xx status (status_code, code, message,
      │                      detail, request_id)
      ├── InvalidInput        422
      ├── PayloadTooLarge     413
      ├── Unauthorized        401
      ├── NotFound            404
      ├── RateLimited         429 (retry_after seconds; retried)
      └── ServerError         5xx
           └── ServiceUnavailable  503 (retried)
                └── ExpertUnavailable  503 naming the expert (expert_id, reason)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ClientClosed",
    "ConnectError",
    "ConnectTimeout",
    "DecodingError",
    "ExpertUnavailable",
    "HTTPStatusError",
    "InputError",
    "InvalidInput",
    "LoadTestConfigError",
    "MomlpError",
    "NetworkError",
    "NotFound",
    "PayloadTooLarge",
    "ProtocolError",
    "RateLimited",
    "ServerError",
    "ServiceUnavailable",
    "TimeoutError",
    "TransportError",
    "Unauthorized",
]


class MomlpError(Exception):
    """Base of every client error; keyword fields become attributes (`exc.expert_id`)."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword-only fields, so the default (cls, args) cannot rebuild one
        # where it is unpickled (a Ray task's error reached the driver as "Failed to
        # deserialize exception"): rebuilt from its args and fields as they are.
        return _rebuilt, (type(self), self.args, self.__dict__)


class InputError(MomlpError, ValueError):
    """The request cannot be sent: inputs not 2-D, ragged, non-numeric or non-finite, or an
    option of the wrong type (`field` names a gate or condition field)."""


class ClientClosed(MomlpError, RuntimeError):
    """A call on a client after `close()` / `aclose()` (or its context manager) ended it.

    A mistake in the caller, not an unreachable server: `health()` raises it too rather than
    answering False.
    """

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message, url=url)
        self.url = url


class LoadTestConfigError(MomlpError, ValueError):
    """A `LoadTestConfig` setting refused; `setting` names the field, `value` holds it.

    Also a `ValueError`, so that callers written against the bare one keep working.
    """

    def __init__(self, message: str, *, setting: str, value: Any) -> None:
        super().__init__(message, setting=setting, value=value)
        self.setting = setting
        self.value = value


class DecodingError(MomlpError):
    """A 2xx answer whose body does not match the v1 contract (the server is another version?)."""

    def __init__(self, message: str, *, url: str, detail: Any = None) -> None:
        super().__init__(message, url=url, detail=detail)
        self.url = url
        self.detail = detail


class TransportError(MomlpError):
    """The request got no HTTP answer; `url` names the endpoint."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message, url=url)
        self.url = url


class ConnectError(TransportError):
    pass


# Shadows the builtin inside this package on purpose: users write `client.TimeoutError`.
class TimeoutError(TransportError):
    pass


class ConnectTimeout(ConnectError, TimeoutError):
    pass


class NetworkError(TransportError):
    pass


class ProtocolError(TransportError):
    pass


class HTTPStatusError(MomlpError):
    """A non-2xx answer, decoded from the server's `{"error": {code, message, detail}}` body.

    `retry_after` is the Retry-After header in seconds (None when absent or an HTTP-date);
    `request_id` is the answer's X-Request-ID, the id the server logged a 5xx under.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        code: str,
        detail: Any = None,
        url: str = "",
        retry_after: float | None = None,
        request_id: str | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(
            message,
            status_code=status_code,
            code=code,
            detail=detail,
            url=url,
            retry_after=retry_after,
            request_id=request_id,
            **fields,
        )
        self.retry_after = retry_after
        self.request_id = request_id
        self.status_code = status_code
        self.code = code
        self.detail = detail
        self.url = url

    def __str__(self) -> str:
        text = f"{self.status_code} {self.code}: {self.message}"
        problems = _schema_problems(self.detail)
        if problems:
            text = f"{text} ({problems})"
        if self.request_id and self.status_code >= 500 and self.request_id not in text:
            # What to quote to the server's operator: its log names a 5xx by this id.
            text = f"{text} [request id {self.request_id}]"
        return text


def _schema_problems(detail: Any, shown: int = 3) -> str:
    """The server's schema errors (`[{"loc", "msg"}, ...]`) as "gate.temperature: Input
    should be greater than 0", so that a traceback names the field, not only "does not match"."""
    if not isinstance(detail, list):
        return ""
    parts = [
        f"{'.'.join(str(part) for part in item.get('loc', ())) or 'body'}: {item['msg']}"
        for item in detail
        if isinstance(item, dict) and "msg" in item
    ]
    more = f"; {len(parts) - shown} more" if len(parts) > shown else ""
    return "; ".join(parts[:shown]) + more


class InvalidInput(HTTPStatusError):
    pass


class PayloadTooLarge(HTTPStatusError):
    pass


class Unauthorized(HTTPStatusError):
    pass


class NotFound(HTTPStatusError):
    pass


class RateLimited(HTTPStatusError):
    """429: the server's queue is full; `retry_after` is its hint in seconds (None if absent)."""


class ServerError(HTTPStatusError):
    pass


class ServiceUnavailable(ServerError):
    pass


class ExpertUnavailable(ServiceUnavailable):
    """503 naming the expert that cannot be loaded; other experts keep serving."""

    def __init__(
        self, message: str, *, expert_id: int | None, reason: str = "", **fields: Any
    ) -> None:
        super().__init__(message, expert_id=expert_id, reason=reason, **fields)
        self.expert_id = expert_id
        self.reason = reason


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc
