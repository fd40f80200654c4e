"""`HotRoutes`: the per-row endpoints answered without FastAPI's router and request plumbing.

Hot: `POST /v1/predict`, `POST /v1/route` and the served model's unversioned v2 infer path.

FastAPI's route layer (exception middleware, two exit stacks, the router's match, the request
wrapper) costs about 0.1 ms of the event loop per request, as much again as parsing a 4-row
JSON body; at a few hundred requests a second on two cores it is CPU the actors need. The
hot endpoints take only the `Request`, so they are called here directly. Everything else, and
every other method on these paths, goes through FastAPI as before. The FastAPI routes of the
hot endpoints stay registered: they document them (OpenAPI) and serve a request this
middleware passes on.

It sits inside the key check, the catch-all and the metrics middleware, so a hot request is
authorised, counted and, when it raises, answered with the same error JSON
(`error_response`, which FastAPI's installed handlers also use).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["Endpoint", "HotRoute", "HotRoutes"]

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class HotRoute:
    """An endpoint `HotRoutes` calls, and its route template (`path`, as on FastAPI's routes).

    The template goes into `scope["route"]` as FastAPI's router would put its route there, so
    the metrics label a hot request by its template too.
    """

    endpoint: Endpoint
    path: str


class HotRoutes:
    """Calls `routes[(method, path)]` for an exact match; passes everything else on."""

    def __init__(self, app: ASGIApp, *, routes: Mapping[tuple[str, str], HotRoute]) -> None:
        self.app = app
        self._routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self._routes.get((scope["method"], scope["path"]))
            if scope["type"] == "http"
            else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route
        response = await route.endpoint(Request(scope, receive, send))
        await response(scope, receive, send)
