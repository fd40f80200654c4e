from __future__ import annotations

import asyncio
import gc
import logging
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from app_support import build_small_store, fake_app
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send

from server._runner import (
    count_connections,
    freeze_heap,
    request_ids_in_access_log,
    uvicorn_config,
)
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

    # Another thread of the test process (one an earlier test left, Ray's among them) may free
    # a frozen object between the two counts, which leaves the permanent generation, and the
    # second count came out 2 lower once in a full run. Without a forced switch of the GIL in
    # between, only this thread runs from the freeze to the second count.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        frozen = freeze_heap()
        count = gc.get_freeze_count()
    finally:
        sys.setswitchinterval(interval)

    assert frozen == count > 0
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


async def test_a_lone_client_skips_the_batch_window_an_idle_connection_keeps_it_open(
    tmp_path: Path,
) -> None:
    # A long gap and window, so that waiting them out cannot pass for not waiting.
    app = fake_app(build_small_store(tmp_path / "store"), max_batch_wait_ms=800.0,
                   batch_gap_ms=400.0)
    server = uvicorn.Server(uvicorn_config(app, Settings(host="127.0.0.1", port=0)))
    count_connections(app, server)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/predict"
        body = {"inputs": [[0.1, 0.2, 0.3, 0.4]], "return_stats": True}
        async with httpx.AsyncClient() as client:
            waited = [
                (await client.post(url, json=body)).json()["stats"]["queue_ms"] for _ in range(3)
            ]
            # Its one connection has the only request: nobody else can join the window.
            assert max(waited) < 200.0
            async with httpx.AsyncClient() as idle:
                assert (await idle.get(url.replace("/v1/predict", "/healthz"))).status_code == 200
                # The idle client's open connection could still send: the window waits.
                assert (await client.post(url, json=body)).json()["stats"]["queue_ms"] >= 390.0
    finally:
        server.should_exit = True
        await serving


async def test_each_access_log_line_ends_with_its_request_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A user reporting a 503 or 504 quotes X-Request-ID; only a 500's log line carried it.
    app = fake_app(build_small_store(tmp_path / "store"))
    server = uvicorn.Server(uvicorn_config(app, Settings(host="127.0.0.1", port=0)))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        with caplog.at_level(logging.INFO, logger="uvicorn.access"), \
                request_ids_in_access_log():
            async with httpx.AsyncClient(base_url=url) as client:
                answers = [
                    await client.post("/v1/predict", json={"inputs": [[0.1, 0.2, 0.3, 0.4]]}),
                    await client.post("/v1/predict", json={"inputs": [[1.0]]}),
                    await client.get("/healthz", headers={"X-Request-ID": "from-the-proxy"}),
                ]
        with caplog.at_level(logging.INFO, logger="uvicorn.access"):
            async with httpx.AsyncClient(base_url=url) as client:
                untagged = await client.get("/healthz")
    finally:
        server.should_exit = True
        await serving
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    ids = [answer.headers["x-request-id"] for answer in (*answers, untagged)]
    assert ids[2] == "from-the-proxy"
    assert lines[0].endswith(f'"POST /v1/predict HTTP/1.1" 200 [request {ids[0]}]')
    assert lines[1].endswith(f'"POST /v1/predict HTTP/1.1" 422 [request {ids[1]}]')
    assert lines[2].endswith('"GET /healthz HTTP/1.1" 200 [request from-the-proxy]')
    assert lines[3].endswith('"GET /healthz HTTP/1.1" 200')  # outside, lines are as before


def test_a_port_in_use_is_refused_before_ray_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # It was found by uvicorn after Ray, the actors and the store were up (8.8 s on 2 cores).
    import socket

    import server.pool
    from server._runner import run_server

    def no_ray(**kwargs: object) -> None:
        raise AssertionError("Ray started")

    monkeypatch.setattr(server.pool, "ray_session", no_ray)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with caplog.at_level("ERROR", logger="server._runner"):
            assert run_server(Settings(store=tmp_path, port=port)) == 1
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in caplog.text
