"""A client that hangs up while its answer is awaited, under real uvicorn on loopback.

uvicorn does not stop a request's handler when its connection is lost: the request stayed in
the batcher's queue and was computed for no one, and an actor's death retried its rows. Now
its wait ends at once (499 in `/metrics`): a request still queued is never computed."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from app_support import BlockingPool, app_settings, build_small_store, fake_app, fake_pool
from loopback_support import serving
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from client import AsyncClient
from client import TimeoutError as SdkTimeout
from server._runner import request_ids_in_access_log
from server._settings import Settings
from server.http import create_app
from server.pool import Group, GroupResult

pytestmark = pytest.mark.unit

PROTOCOLS = [pytest.param(HttpToolsProtocol, id="httptools"), pytest.param(H11Protocol, id="h11")]


class CountingPool(BlockingPool):
    """The first run waits for the gate; counts the rows every run computes."""

    rows = 0

    async def run(
        self, groups: list[Group], *, wanted: Callable[[], bool] | None = None
    ) -> list[GroupResult]:
        self.rows += sum(int(group.rows.shape[0]) for group in groups)
        return await super().run(groups, wanted=wanted)


def _post(rows: list[list[float]], request_id: str = "") -> bytes:
    body = json.dumps({"inputs": rows}).encode()
    head = (
        "POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + (f"x-request-id: {request_id}\r\n" if request_id else "")
        + f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(1000):  # bounded: 10 s
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never reached")


def held_app(tmp_path: Path) -> tuple[Any, list[CountingPool]]:
    """An app whose first pool run waits for the gate, with one batch in flight: a request
    sent meanwhile waits in the queue behind the held one. Its pool is in the list once the
    app's lifespan has started."""
    pools: list[CountingPool] = []

    def pool_factory(settings: Settings) -> CountingPool:
        pools.append(CountingPool(fake_pool(settings), blocked=1))
        return pools[0]

    settings = app_settings(build_small_store(tmp_path / "store"), max_inflight_batches=1)
    return create_app(settings, pool_factory=pool_factory), pools


def _predicts(metrics: str, status: int) -> float:
    """How many /v1/predict answers of `status` the metrics count."""
    return _sample(metrics, f'momlp_requests_total{{endpoint="/v1/predict",status="{status}"}}')


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_a_queued_request_whose_client_hung_up_is_never_computed(
    tmp_path: Path, base: type[asyncio.Protocol], caplog: pytest.LogCaptureFixture
) -> None:
    app, pools = held_app(tmp_path)
    generator = np.random.default_rng(5)
    first = generator.uniform(-1, 1, (3, 4)).tolist()
    second = generator.uniform(-1, 1, (5, 4)).tolist()
    caplog.set_level(logging.INFO)
    async with app.router.lifespan_context(app), serving(app, base) as port:
        pool = pools[0]
        batcher = app.state.serving.current().batcher
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            held = asyncio.create_task(client.post("/v1/predict", json={"inputs": first}))
            await asyncio.wait_for(pool.entered.wait(), 10)
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            with request_ids_in_access_log():
                writer.write(_post(second, request_id="gone-1"))
                await writer.drain()
                await _until(lambda: batcher.queued_rows == 3 + 5)  # queued behind the held one
                writer.close()  # the client hangs up
                await writer.wait_closed()
                await _until(lambda: batcher.queued_rows == 3)  # left the queue at once
            pool.gate.set()
            answered = await asyncio.wait_for(held, 10)
            metrics = (await client.get("/metrics")).text
    assert answered.status_code == 200
    assert pool.rows == 3  # the second request's 5 rows were never computed
    assert _predicts(metrics, 499) == 1.0
    # The access log has the hang-up, as a proxy's would, with its request's id.
    access = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    hang_ups = [line for line in access if '" 499' in line]
    assert len(hang_ups) == 1
    assert hang_ups[0].startswith("127.0.0.1:")
    assert hang_ups[0].endswith('"POST /v1/predict HTTP/1.1" 499 [request gone-1]')
    told = [r.getMessage() for r in caplog.records if r.name == "server.http._errors"]
    assert told == ["the client closed the connection before /v1/predict was answered"
                    " [request gone-1]"]


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_a_pipelined_request_whose_client_hung_up_is_never_computed(
    tmp_path: Path, base: type[asyncio.Protocol]
) -> None:
    # Two requests in one write: httptools makes the second one's cycle the connection's
    # current one while the first is still awaited, so the first was computed for no one.
    app, pools = held_app(tmp_path)
    generator = np.random.default_rng(7)
    first, second, third = (generator.uniform(-1, 1, (n, 4)).tolist() for n in (3, 5, 2))
    async with app.router.lifespan_context(app), serving(app, base) as port:
        pool = pools[0]
        batcher = app.state.serving.current().batcher
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            held = asyncio.create_task(client.post("/v1/predict", json={"inputs": first}))
            await asyncio.wait_for(pool.entered.wait(), 10)
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post(second) + _post(third))
            await writer.drain()
            await _until(lambda: batcher.queued_rows == 3 + 5)  # the first of the two waits
            writer.close()  # the client hangs up
            await writer.wait_closed()
            await _until(lambda: batcher.queued_rows == 3)  # left the queue at once
            pool.gate.set()
            answered = await asyncio.wait_for(held, 10)
            metrics = (await client.get("/metrics")).text
    assert answered.status_code == 200
    assert pool.rows == 3  # neither pipelined request was computed
    assert _predicts(metrics, 200) == 1
    assert _predicts(metrics, 499) == 1


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_a_client_that_stays_is_answered_and_a_kept_alive_connection_serves_on(
    tmp_path: Path, base: type[asyncio.Protocol]
) -> None:
    # The hook acts only while an answer is awaited: a connection lost after its answer
    # (or between two requests on it) touches nothing.
    app = fake_app(build_small_store(tmp_path / "store"))
    rows = np.random.default_rng(6).uniform(-1, 1, (4, 4)).tolist()
    async with app.router.lifespan_context(app), serving(app, base) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            answers = [await client.post("/v1/predict", json={"inputs": rows}) for _ in range(3)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            metrics = (await client.get("/metrics")).text
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].json()["outputs"] == answers[2].json()["outputs"]
    assert _predicts(metrics, 200) == 3
    assert _predicts(metrics, 499) == 0


@pytest.mark.parametrize("base", PROTOCOLS)
async def test_pipelined_requests_are_all_answered_in_order(
    tmp_path: Path, base: type[asyncio.Protocol]
) -> None:
    # The cycles a pipelined request's replaced are remembered only until they are answered:
    # three requests in one write get their three answers, and a hang-up after them is a
    # no-op.
    app = fake_app(build_small_store(tmp_path / "store"))
    generator = np.random.default_rng(8)
    batches = [generator.uniform(-1, 1, (n, 4)).tolist() for n in (1, 2, 3)]
    async with app.router.lifespan_context(app), serving(app, base) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"".join(_post(rows) for rows in batches))
        await writer.drain()
        answers = []
        for _ in batches:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = json.loads(await asyncio.wait_for(reader.readexactly(length), 10))
            answers.append((head.split(b" ")[1], len(body["outputs"])))
        writer.close()
        await writer.wait_closed()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            metrics = (await client.get("/metrics")).text
    assert answers == [(b"200", 1), (b"200", 2), (b"200", 3)]
    assert _predicts(metrics, 499) == 0


async def test_an_sdk_call_that_times_out_is_a_timeout_there_and_a_499_here(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The SDK gives up on a queued request: it raises its TimeoutError (not retried), its
    # connection is dropped, and the server stops waiting for that answer: nothing computed,
    # a 499 counted, nothing logged above INFO.
    app, pools = held_app(tmp_path)
    generator = np.random.default_rng(9)
    first = generator.uniform(-1, 1, (3, 4)).tolist()
    second = generator.uniform(-1, 1, (5, 4))
    async with app.router.lifespan_context(app), serving(app) as port:
        pool = pools[0]
        batcher = app.state.serving.current().batcher
        base_url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base_url) as client:
            held = asyncio.create_task(client.post("/v1/predict", json={"inputs": first}))
            await asyncio.wait_for(pool.entered.wait(), 10)
            async with AsyncClient(base_url, timeout=2.0, max_retries=0) as sdk:
                with pytest.raises(SdkTimeout):
                    await sdk.predict(second)
            await _until(lambda: batcher.queued_rows == 3)
            pool.gate.set()
            answered = await asyncio.wait_for(held, 10)
            metrics = (await client.get("/metrics")).text
    assert answered.status_code == 200
    assert pool.rows == 3
    assert _predicts(metrics, 499) == 1
    assert [r.getMessage() for r in caplog.records if r.levelno > logging.INFO] == []
