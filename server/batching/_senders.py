"""How many clients could still add a request to a batch window: the server's open connections.

Under HTTP/1.1 a connection carries one request at a time (uvicorn reads a pipelined second
request only after answering the first). So once every open connection has a request waiting
in a batcher, queued or in a running batch, no other request can join the window before the
batcher answers one of them, and waiting out the rest of the window only delays them all. With
16 closed-loop clients that wait was ~1.2 ms of every ~9.3 ms batch cycle (the 0.6 ms gap
becomes ~1 ms under uvloop's millisecond timers): benchmarks/RESULTS.md, "Eleventh session".

The HTTP server owns the count; the batcher only reads it. `run_server` attaches uvicorn's.
Without a count (an in-process ASGI client in tests, another ASGI server) windows close as
they always did.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["OpenConnections"]


class OpenConnections:
    """The number of HTTP connections open now, once a server has attached its count."""

    def __init__(self) -> None:
        self._count: Callable[[], int] | None = None

    def attach(self, count: Callable[[], int]) -> None:
        """Read the open connections from `count` from now on."""
        self._count = count

    def __call__(self) -> int | None:
        """Connections open now; None when no server attached a count."""
        return None if self._count is None else self._count()
