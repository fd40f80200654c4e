"""Cancellation and shutdown paths that steady load never takes: a close in the loop turn a
batch was made, a cancel before a call's first step, a swap while a request still reads its
body, a reload past its timeout, a stop during a retire (a review of the sixty-sixth session;
each test failed before its fix)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from app_support import (
    BlockingPool,
    app_settings,
    build_small_store,
    fake_app,
    manifest,
    running,
)
from test_channel import REFS, reply_for

import server.serving._state as state_module
from experts_store import Store
from server import PoolClosed, create_app
from server.pool import Channel, ChannelServer, FakeExpertPool, Group, RayExpertPool

pytestmark = pytest.mark.unit


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return build_small_store(tmp_path / "store")


async def test_a_close_in_the_turn_a_batch_was_made_answers_its_requests(store: Path) -> None:
    # The collector made the batch's task and close() cancelled it before its first step:
    # `_process` never ran, and its request waited for good.
    app = fake_app(store, max_batch_wait_ms=50.0)
    async with running(app):
        batcher = app.state.serving.version.batcher
        closing: list[asyncio.Future[None]] = []

        def connections() -> int:
            # Called by the collector just before it takes the batch: close in this turn.
            if not closing:
                closing.append(asyncio.ensure_future(batcher.close()))
            return 1  # one open connection, with its request waiting: the window closes

        batcher._open_connections = connections
        request = asyncio.ensure_future(batcher.submit(np.zeros((1, 4), np.float32)))
        while not closing:
            await asyncio.sleep(0.01)
        await closing[0]
        with pytest.raises(PoolClosed):
            await asyncio.wait_for(request, 3.0)
        assert batcher.queued_rows == 0


async def test_a_batch_cancelled_before_its_calls_start_leaves_no_rows_queued(
    store: Path,
) -> None:
    pool = FakeExpertPool(app_settings(store))
    opened = Store.open(store)
    groups = [Group(opened.expert_ref(i), torch.zeros(5, 4)) for i in range(4)]
    try:
        for _ in range(3):
            batch = asyncio.ensure_future(pool.run(groups))
            await asyncio.sleep(0)  # placed, and the calls scheduled but not started
            batch.cancel()
            await asyncio.gather(batch, return_exceptions=True)
        # Each cancelled batch left its rows counted as queued on their actors.
        assert {a: pool.dispatcher.queued_rows(a) for a in pool.dispatcher.names} == {
            a: 0 for a in pool.dispatcher.names
        }
    finally:
        await pool.close()


async def test_a_channel_call_cancelled_before_it_is_written_keeps_no_pending_entry(
    tmp_path: Path,
) -> None:
    release = threading.Event()

    def busy(payload: Any) -> Any:
        release.wait(5)
        return reply_for(payload)

    server = ChannelServer(tmp_path / "a.sock", busy)
    channel = await Channel.connect(tmp_path / "a.sock")
    try:
        small = [(REFS[0], np.zeros((1, 5), np.float32))]
        async with channel._write_lock:  # another call is writing
            waiting = asyncio.ensure_future(channel.run(small))
            await asyncio.sleep(0.05)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        # Its entry stayed, holding the reply's arrays once answered ("never retrieved" at
        # close if not).
        assert channel._pending == {}
    finally:
        release.set()
        await channel.close()
        server.close()


async def test_the_pool_closes_with_a_call_in_flight_on_its_channel(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The call woke on its channel's close and dropped its entry while the shutdown iterated
    # over them: RuntimeError, and the actors were not killed nor the socket folder removed.
    import ray

    killed: list[Any] = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart: killed.append(handle))
    gate = threading.Event()
    folder = tmp_path / "channels"
    folder.mkdir()
    server = ChannelServer(folder / "actor-0.sock", lambda p: (gate.wait(5), reply_for(p))[1])
    handle = object()
    pool = RayExpertPool({"actor-0": handle}, device="cpu", settings=app_settings(store, actors=1),
                         channels=folder, node_id="n")
    pool._channels["actor-0"] = await Channel.connect(folder / "actor-0.sock")
    batch = asyncio.ensure_future(
        pool.run([Group(Store.open(store).expert_ref(0), torch.zeros(2, 4))])
    )
    await asyncio.sleep(0.2)  # the batch waits for the actor's answer
    try:
        await pool.close()
        assert killed == [handle] and not folder.exists()
        with pytest.raises(PoolClosed):
            await batch
    finally:
        gate.set()
        server.close()


async def test_a_swap_waits_for_a_request_still_reading_its_body(store: Path) -> None:
    # The old version was closed after request_timeout_s, while the request (inside its body
    # timeout) still uploaded: 503 "the expert pool is shut down".
    app = fake_app(store, request_timeout_s=1.0, body_timeout_s=10.0)
    async with running(app) as client:
        body = json.dumps({"inputs": [[0.1, 0.2, 0.3, 0.4]]}).encode()

        async def trickle() -> Any:
            yield body[:5]
            await asyncio.sleep(2.0)
            yield body[5:]

        request = asyncio.ensure_future(client.post(
            "/v1/predict", content=trickle(),
            headers={"content-type": "application/json", "content-length": str(len(body))},
        ))
        await asyncio.sleep(0.2)
        build_small_store(store, seed=1)
        assert await app.state.serving.swap()
        answer = await request
    assert answer.status_code == 200, answer.text


async def test_a_reload_past_its_timeout_still_puts_the_publish_it_followed_live(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reload's timeout cancelled swap() while it waited out an earlier swap, before it
    # started its own: its 504 said the swap goes on, and the publish never went live.
    opener = state_module._open_version_files
    opening, finish = threading.Event(), threading.Event()

    def slow_open(*args: Any) -> Any:
        opened = opener(*args)
        opening.set()
        finish.wait(10)  # a large store's open, until the reload has timed out
        return opened

    app = fake_app(store, request_timeout_s=0.5)
    async with running(app) as client:
        monkeypatch.setattr(state_module, "_open_version_files", slow_open)
        serving = app.state.serving
        build_small_store(store, seed=1)
        first = asyncio.ensure_future(serving.swap())
        try:
            assert await asyncio.to_thread(opening.wait, 10)
            build_small_store(store, seed=2)
            published = manifest(store)["store_version"]
            reload = await client.post("/v1/admin/reload")
            assert reload.status_code == 504
        finally:
            finish.set()
        await first
        for _ in range(100):
            if serving.version.version == published:
                break
            await asyncio.sleep(0.05)
        assert serving.version.version == published


async def test_a_stop_during_a_retire_closes_the_old_version_before_the_pool(
    store: Path,
) -> None:
    seen: dict[str, Any] = {}

    def pool_factory(settings: Any) -> Any:
        pool = BlockingPool(FakeExpertPool(settings), blocked=1)
        close = pool.close

        async def watched_close() -> None:
            old = seen["old"].batcher
            seen["at_pool_close"] = (old._closed, len(old._inflight))
            await close()

        pool.close = watched_close  # type: ignore[method-assign]
        seen["pool"] = pool
        return pool

    app = create_app(app_settings(store, request_timeout_s=30.0), pool_factory=pool_factory)
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    try:
        serving = app.state.serving
        seen["old"] = serving.version
        request = asyncio.ensure_future(
            client.post("/v1/predict", json={"inputs": [[0.1, 0.2, 0.3, 0.4]]})
        )
        await seen["pool"].entered.wait()  # its batch is inside the pool
        build_small_store(store, seed=1)
        assert await serving.swap()
        await asyncio.sleep(0.1)
        collector = seen["old"].batcher._collector
    finally:
        await lifespan.__aexit__(None, None, None)
    # The old version's batcher was left open, its batch in flight, when the pool closed.
    assert seen["at_pool_close"] == (True, 0)
    assert collector is not None and collector.done()
    # ... and let go: its CancelledError's frame holds the batcher (tests/server/
    # test_swap_memory.py).
    assert seen["old"].batcher._collector is None
    assert (await request).status_code == 503
    await client.aclose()


async def test_a_probe_ray_answers_with_another_error_keeps_the_revival_polling(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only RayActorError was a failed probe: a RaySystemError (or a lost object) ended the
    # revival task unseen, and the actor stayed marked dead until another death was noticed.
    import ray
    from ray.exceptions import RaySystemError

    from server.pool import ActorDied

    class Probe:
        def options(self, **_: Any) -> Any:  # the probe's concurrency group
            return self

        def remote(self) -> Any:
            async def fail() -> None:
                raise RaySystemError("the raylet is restarting")
            return fail()

    class Handle:
        info = Probe()

    monkeypatch.setattr(ray, "kill", lambda handle, no_restart: None)
    pool = RayExpertPool({"actor-0": Handle()}, device="cpu",
                         settings=app_settings(store, actors=1), channels=None, node_id="n")
    try:
        with pytest.raises(ActorDied):
            await pool._call_info("actor-0")
    finally:
        await pool.close()


async def test_a_swap_that_fails_after_its_reload_answered_504_is_logged(
    store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # With the watcher off nothing else would ever say that the publish did not go live.
    finish = threading.Event()

    def slow_failure(*args: Any) -> Any:
        finish.wait(10)  # fails only once its reload has answered 504
        raise OSError("the store's disk went away")

    app = fake_app(store, request_timeout_s=0.3)
    async with running(app) as client:
        monkeypatch.setattr(state_module, "_open_version_files", slow_failure)
        build_small_store(store, seed=1)
        try:
            assert (await client.post("/v1/admin/reload")).status_code == 504
        finally:
            finish.set()
        for _ in range(60):
            if "a store swap whose caller left failed" in caplog.text:
                break
            await asyncio.sleep(0.05)
    assert "a store swap whose caller left failed: the store's disk went away" in caplog.text
