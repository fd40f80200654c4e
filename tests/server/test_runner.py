from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send

from server._runner import freeze_heap, uvicorn_config
from server._settings import Settings

pytestmark = pytest.mark.unit


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session keeps a normal GC


def test_freeze_heap_exempts_what_is_alive_and_collects_garbage_first(unfrozen: None) -> None:
    kept = Node()
    first, second = Node(), Node()
    first.other, second.other = second, first  # a cycle that only the cyclic GC can free
    cycle = weakref.ref(first)
    del first, second

    frozen = freeze_heap()

    assert frozen == gc.get_freeze_count() > 0
    assert cycle() is None  # collected, not frozen
    # Frozen objects are no longer on the lists a collection traverses.
    assert not any(obj is kept for obj in gc.get_objects())


async def _hello(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http":
        await PlainTextResponse("hello")(scope, receive, send)


@pytest.mark.parametrize("access_log", [True, False])
async def test_the_access_log_has_one_line_per_request_unless_turned_off(
    access_log: bool, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(host="127.0.0.1", port=0, access_log=access_log)
    server = uvicorn.Server(uvicorn_config(_hello, settings))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        with caplog.at_level(logging.INFO, logger="uvicorn.access"):
            async with httpx.AsyncClient() as client:
                for _ in range(3):
                    answer = await client.get(f"http://127.0.0.1:{port}/hi")
                    assert answer.text == "hello"
    finally:
        server.should_exit = True
        await serving
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert len(lines) == (3 if access_log else 0)
    assert all("GET /hi" in line and "200" in line for line in lines)
