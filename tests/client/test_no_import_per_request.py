"""An async request over a real socket searches for no module.

httpcore 1.0 imports sniffio inside every async request (and more than once a request), and
anyio no longer installs sniffio. Without it each of those imports fails only after searching
sys.path: 0.3-0.5 ms of the load generator's CPU a request, and the same for every AsyncClient
user (benchmarks/RESULTS.md, "loadtest: the generator's own cost over a real socket").
pyproject.toml therefore depends on sniffio; this test fails if any library under the client
goes back to searching for a module on every request.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

import pytest

from client import AsyncClient

pytestmark = pytest.mark.unit

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


class Lookups(importlib.abc.MetaPathFinder):
    """Records the name of every module Python searches for; finds none itself."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        self.names.append(fullname)
        return None


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 server that answers every request with "ok"."""
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def test_requests_after_the_first_search_for_no_module() -> None:
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lookups = Lookups()
    async with server, AsyncClient(f"http://127.0.0.1:{port}", max_retries=0) as client:
        # The first request imports what the stack imports lazily, once.
        assert await client.metrics() == "ok"
        sys.meta_path.insert(0, lookups)
        try:
            for _ in range(5):
                assert await client.metrics() == "ok"
        finally:
            sys.meta_path.remove(lookups)
    assert lookups.names == []
