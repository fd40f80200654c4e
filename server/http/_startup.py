"""A store the server cannot serve is reported at startup in one line, not a traceback.

Starlette answers a failed lifespan with the whole traceback as its message, and uvicorn logs
that message. For the known reasons not to start (an expert larger than the cache budget, a
store kind this server does not know, a missing or corrupt manifest or router, actors that
cannot be placed) the user would read a traceback to find one sentence. The lifespan records
such a reason in a `StartupFailure`; `reporting_send` wraps the lifespan's `send` so that the
reason replaces the traceback (`CatchAllMiddleware` applies it to the lifespan, so no request
pays for another middleware layer). Any other exception is a defect and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Message, Send

from experts_store import StoreError
from router import RouterError
from server._exceptions import ServerError

__all__ = ["STARTUP_ERRORS", "StartupFailure", "reporting_send"]

# The packages' own exception trees: each is raised on purpose, with a message for the user.
STARTUP_ERRORS: tuple[type[Exception], ...] = (ServerError, StoreError, RouterError)


@dataclass
class StartupFailure:
    """Why the lifespan could not start, when it was one of `STARTUP_ERRORS`."""

    message: str | None = None


def reporting_send(send: Send, failure: StartupFailure) -> Send:
    """The lifespan's `send`, with `failure.message` (when set) as its startup-failed message."""

    async def send_reason(message: Message) -> None:
        reason = failure.message
        if message["type"] == "lifespan.startup.failed" and reason is not None:
            message = {"type": message["type"], "message": reason}
        await send(message)

    return send_reason
