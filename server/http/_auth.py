"""Bearer-key check for every endpoint but the health probes, when the settings hold a key."""

from __future__ import annotations

import hmac

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server._exceptions import HttpError

__all__ = ["ApiKeyMiddleware", "OPEN_PATHS"]

# The probes stay open: an orchestrator's HTTP probe cannot read the key from a secret (a
# Kubernetes httpGet probe's headers are literal text in the pod spec), and they tell nothing
# but "up" and "ready". Everything else, the rest of /v2 included, needs the key.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


class ApiKeyMiddleware:
    """Refuses (401) a request whose `Authorization: Bearer <key>` does not match.

    The key is compared in constant time and never logged or echoed.
    """

    def __init__(self, app: ASGIApp, *, api_key: SecretStr | None) -> None:
        self.app = app
        self._key = None if api_key is None else api_key.get_secret_value().encode()

    def allows(self, authorization: str | None) -> bool:
        if self._key is None:
            return True
        if authorization is None:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._key is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if not self.allows(Headers(scope=scope).get("authorization")):
            raise HttpError(
                401,
                "unauthorized",
                "a valid bearer key is required (Authorization: Bearer <key>)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        await self.app(scope, receive, send)
