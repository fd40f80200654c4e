"""`ClientLeases`: the load generator's clients, one per request in flight.

One `AsyncClient` for every request of a load test puts all of its connections in one httpx
connection pool, and httpcore's pool walks every connection it holds, polling each idle
one's socket, whenever a request starts or ends (encode/httpx#3215). With 16 requests in
flight on the 2-core VM that walk cost `momlp loadtest` ~0.26 ms of CPU a request, a third of
what it spent, and a request whose answer had come waited behind the walks of the others:
p99 59 ms against 16 ms with a client per request in flight, and locust's 13 ms on the same
server (benchmarks/RESULTS.md, "loadtest: the generator's own cost over a real socket"). A
client per request in flight keeps each pool at one connection, as locust keeps one per user.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType

from ._async_client import AsyncClient
from ._exceptions import TimeoutError

__all__ = ["ClientLeases"]


class ClientLeases:
    """At most `limit` clients made by `make`, each lent to one request at a time.

    A lease takes an idle client, or makes one while fewer than `limit` exist, or waits for
    one to come back; requests beyond `limit` in flight wait as they did in one client's
    pool of `limit` connections, and, as there, a wait longer than `wait_s` is a
    `TimeoutError` naming `url`. Every client made is closed on leaving the `async with`.
    """

    def __init__(
        self, make: Callable[[], AsyncClient], limit: int, *, wait_s: float | None, url: str
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self._make = make
        self._limit = limit
        self._wait_s = wait_s
        self._url = url
        self._free = asyncio.Semaphore(limit)
        self._idle: list[AsyncClient] = []
        self._stack = AsyncExitStack()
        self.made = 0

    async def __aenter__(self) -> ClientLeases:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._idle.clear()
        await self._stack.aclose()

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[AsyncClient]:
        if not self._free.locked():
            # A slot is free, so acquire() returns at once: no timer to arm (one per request
            # costs ~3.5 µs, more than the rest of a lease).
            await self._free.acquire()
        else:
            try:
                async with asyncio.timeout(self._wait_s):
                    await self._free.acquire()
            except builtins.TimeoutError:
                raise TimeoutError(
                    f"no connection free within {self._wait_s} s "
                    f"(all {self._limit} clients busy)",
                    url=self._url,
                ) from None
        try:
            if self._idle:
                client = self._idle.pop()
            else:
                client = await self._stack.enter_async_context(self._make())
                self.made += 1
            try:
                yield client
            finally:
                # Last in, first out: the connection used most recently is the one most
                # likely still open on the server's side.
                self._idle.append(client)
        finally:
            self._free.release()
