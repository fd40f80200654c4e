"""The one place that turns an exception into the HTTP error JSON.

`{"error": {"code", "message", "detail"}}` for every non-2xx answer: our own errors, FastAPI's
validation errors, Starlette's 404/405, and anything unexpected (500 `internal`, logged here,
never a traceback to the client).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from experts_store import ExpertLoadError, own_file_problem
from router import RouterInputError
from server._exceptions import (
    ActorFailed,
    ExpertUnavailable,
    HttpError,
    InvalidRequest,
    NotReady,
    PoolClosed,
    PoolSaturated,
    RequestTimeout,
    ServerError,
)
from server.http._request_id import current_request_id
from server.http._startup import StartupFailure, reporting_send

__all__ = ["V2_PREFIX", "CatchAllMiddleware", "error_response", "install_error_handlers"]

V2_PREFIX = "/v2"
# The expert id experts_store's reader stands in for a hyper store's hypernetwork f, which is
# no expert: an error of f is told as f's (experts_store._hypernet.GENERATOR_ID).
_GENERATOR_ID = -1

logger = logging.getLogger(__name__)
_ACCESS = logging.getLogger("uvicorn.access")

_HTTP_CODES = {
    400: "invalid_input",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
    429: "pool_saturated",
    503: "not_ready",
    504: "timeout",
}


def _json(
    status: int, code: str, message: str, detail: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "detail": detail}}
    try:
        return JSONResponse(body, status_code=status, headers=headers)
    except ValueError:
        # A detail that echoes a refused value may hold NaN or an infinity, which JSON cannot
        # carry: an error handler that raised would leave uvicorn to answer a bare 500.
        body["error"]["detail"] = _json_safe(detail)
        return JSONResponse(body, status_code=status, headers=headers)


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float written as its repr ("nan", "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def _sanitized(errors: Any) -> list[dict[str, Any]]:
    # FastAPI's errors carry the raw input and exception objects in ctx: neither is safe to echo.
    out: list[dict[str, Any]] = []
    for err in list(errors)[:20]:
        out.append(
            {
                "loc": [str(part) for part in err.get("loc", ())],
                "msg": str(err.get("msg", "")),
                "type": str(err.get("type", "")),
            }
        )
    return out


def _server_error(exc: ServerError, error_id: str | None) -> JSONResponse:
    if isinstance(exc, PoolSaturated):
        retry = max(1, math.ceil(exc.retry_after_s))
        return _json(
            429,
            "pool_saturated",
            exc.message,
            {"retry_after_s": exc.retry_after_s},
            {"Retry-After": str(retry)},
        )
    if isinstance(exc, ExpertUnavailable):
        detail: dict[str, Any] = {"expert_id": exc.expert_id, "reason": exc.reason}
        if exc.node is not None:
            detail["node"] = exc.node
        if exc.hypernetwork is not None:
            detail["hypernetwork"] = exc.hypernetwork
        headers = None
        if exc.retry_after_s is not None:
            # The pool does not read a bad file again before this: a retry sooner gets the
            # same 503 (a republished fix has another hash and is read at once).
            detail["retry_after_s"] = exc.retry_after_s
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        return _json(503, "expert_unavailable", exc.message, detail, headers)
    if isinstance(exc, NotReady | PoolClosed):
        return _json(503, "not_ready", exc.message, exc.fields or None)
    if isinstance(exc, ActorFailed):
        return _json(503, "actor_failed", exc.message, exc.fields)
    if isinstance(exc, RequestTimeout):
        return _json(504, "timeout", exc.message, exc.fields)
    if isinstance(exc, InvalidRequest):
        return _json(422, "invalid_input", exc.message, exc.fields)
    error_id = error_id or _error_id()
    logger.error("[error %s] unmapped server error %s: %s", error_id, type(exc).__name__, exc)
    return _internal(error_id)


def error_response(exc: BaseException, path: str = "", request_id: str | None = None) -> Response:
    """The error JSON for `exc`; unexpected exceptions are logged and become 500 `internal`,
    their error id the request's id where it has one (`X-Request-ID`).

    Under `/v2` (the Open Inference Protocol) the body is the protocol's `{"error": "..."}`
    and a refused input is 400, as its clients expect.
    """
    response = _v1_error_response(exc, path, request_id)
    return _as_v2(response) if path.startswith(V2_PREFIX) else response


def _as_v2(response: JSONResponse) -> Response:
    body = json.loads(bytes(response.body))["error"]
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
    status = 400 if response.status_code == 422 else response.status_code
    return JSONResponse({"error": body["message"]}, status_code=status, headers=headers)


def _v1_error_response(exc: BaseException, path: str, error_id: str | None) -> JSONResponse:
    if isinstance(exc, HttpError):
        return _json(exc.status, exc.code, exc.message, exc.detail, exc.headers)
    if isinstance(exc, ServerError):
        return _server_error(exc, error_id)
    if isinstance(exc, RequestValidationError):
        return _json(422, "invalid_input", "the request is not valid", _sanitized(exc.errors()))
    if isinstance(exc, RouterInputError):
        return _json(422, "invalid_input", str(exc))
    if isinstance(exc, ExpertLoadError):
        expert_id = getattr(exc, "expert_id", None)
        if expert_id == _GENERATOR_ID:
            reason = own_file_problem("hypernetwork", exc)
            return _json(
                503,
                "expert_unavailable",
                f"no expert can be generated: {reason}",
                {"expert_id": expert_id, "reason": reason},
            )
        return _json(
            503,
            "expert_unavailable",
            f"expert {expert_id} cannot be served: {exc}",
            {"expert_id": expert_id, "reason": str(exc)},
        )
    if isinstance(exc, StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code)
        if code is None:
            code = "internal" if exc.status_code >= 500 else "http_error"
        message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
        headers = dict(exc.headers) if exc.headers else None
        return _json(exc.status_code, code, message, None, headers)
    if isinstance(exc, ClientDisconnect):
        # Nobody reads this answer: its status is what /metrics and the access line count, a
        # client's hang-up and not a server fault (499, as nginx names it).
        logger.info("the client closed the connection before %s was answered%s",
                    path or "a request", f" [request {error_id}]" if error_id else "")
        return _json(499, "client_closed_request", "the client closed the connection")
    error_id = error_id or _error_id()
    logger.error("[error %s] unhandled %s while serving %s", error_id, type(exc).__name__,
                 path or "a request", exc_info=exc)
    return _internal(error_id)


def _error_id() -> str:
    return secrets.token_hex(6)


def _internal(error_id: str) -> JSONResponse:
    # The id is in the log line that holds the traceback: a user reporting the 500 can quote
    # it, and the operator finds the cause without matching timestamps.
    return _json(500, "internal", f"internal server error (error id {error_id} in the server's"
                 " log)", {"error_id": error_id})


def _answer(exc: BaseException, scope: Scope) -> Response:
    if isinstance(exc, ClientDisconnect):
        _log_hang_up(scope)
    return error_response(exc, scope.get("path", ""), current_request_id())


def _log_hang_up(scope: Scope) -> None:
    # uvicorn writes no access line for a connection that is gone; this one has the form of
    # its lines (and, on the same logger, its request id and its on/off setting), so the
    # access log shows the hang-ups as a proxy's log would.
    client = scope.get("client")
    query = scope.get("query_string", b"")
    target = scope.get("path", "") + (f"?{query.decode('latin-1')}" if query else "")
    _ACCESS.info('%s - "%s %s HTTP/%s" %d', f"{client[0]}:{client[1]}" if client else "-",
                 scope.get("method", ""), target, scope.get("http_version", "1.1"), 499)


async def _handle(request: Request, exc: Exception) -> Response:
    return _answer(exc, request.scope)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception class the app may raise to `error_response`."""
    for exc_class in (
        HttpError,
        ServerError,
        RequestValidationError,
        RouterInputError,
        ExpertLoadError,
        StarletteHTTPException,
    ):
        app.add_exception_handler(exc_class, _handle)


class CatchAllMiddleware:
    """Turns anything that escaped the handlers into a logged 500 with the error JSON.

    Starlette's own `Exception` handler re-raises after answering, which would put a traceback
    on the server's console and into test clients; this one answers and stops there. With
    `startup`, a known reason the lifespan could not start replaces its traceback too.
    """

    def __init__(self, app: ASGIApp, *, startup: StartupFailure | None = None) -> None:
        self.app = app
        self._startup = startup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan" and self._startup is not None:
                send = reporting_send(send, self._startup)
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            if started:
                # Headers are out: nothing to answer with, the server closes the connection.
                logger.error("error after the response started", exc_info=exc)
                return
            await _answer(exc, scope)(scope, receive, send)
