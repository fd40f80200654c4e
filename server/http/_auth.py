"""Bearer-key check for every endpoint but the health probes, when the settings hold a key."""

from __future__ import annotations

import hmac

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from server._exceptions import HttpError

__all__ = ["ApiKeyMiddleware", "OPEN_PATHS", "bearer_key"]

# The probes stay open: an orchestrator's HTTP probe cannot read the key from a secret (a
# Kubernetes httpGet probe's headers are literal text in the pod spec), and they tell nothing
# but "up" and "ready". Everything else, the rest of /v2 included, needs the key.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


def bearer_key(api_key: SecretStr | None) -> bytes | None:
    """The key a request must present, as the bytes a client sends (UTF-8); None when no key
    is set, which a blank one is too.

    Whitespace around the key is no part of it: a header value cannot carry it (HTTP strips
    it), and a key read from a file or a Kubernetes secret often ends in a newline, which no
    client could then ever match. A blank key (`MOMLP_API_KEY=`) was a key that the header
    `Authorization: Bearer` matched, from anywhere, admin reload included.
    """
    if api_key is None:
        return None
    return api_key.get_secret_value().strip().encode("utf-8") or None


class ApiKeyMiddleware:
    """Refuses (401) a request whose `Authorization: Bearer <key>` does not match.

    The key is compared in constant time and never logged or echoed.
    """

    def __init__(self, app: ASGIApp, *, api_key: SecretStr | None) -> None:
        self.app = app
        self._key = bearer_key(api_key)

    def allows(self, authorization: bytes | None) -> bool:
        """Whether the raw `Authorization` header value (bytes, as the client sent them)
        carries the key."""
        if self._key is None:
            return True
        if authorization is None:
            return False
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # The bytes as sent: a key beyond ASCII is sent as UTF-8, which a str decoded from
        # latin-1 (Starlette's headers) and encoded again as UTF-8 never equals.
        return hmac.compare_digest(token.strip(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._key is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if not self.allows(_authorization(scope)):
            raise HttpError(
                401,
                "unauthorized",
                "a valid bearer key is required (Authorization: Bearer <key>)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        await self.app(scope, receive, send)


def _authorization(scope: Scope) -> bytes | None:
    # The first one, as Starlette's `Headers.get` takes; ASGI servers give names in lower case.
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bytes(value)
    return None
