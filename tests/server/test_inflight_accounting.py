"""Work in flight after its caller left or a call of its batch failed: the queue limit counts
rows until they are computed, a failed batch is answered at once but holds its slot (its rows
still counted) until its last call ends, and a late failure of an old actor process keeps the
channel a restart opened and leaves the restarted actor alive (reviews of the sixty-seventh
session; the slot and its rows, of the sixty-ninth). The tests of those failed before their
fixes; the two of a caller leaving while queued, the batch window and a failed batch with
nothing left computing guard what was right already."""

from __future__ import annotations

import asyncio
import collections
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from app_support import app_settings, build_small_store
from test_batcher import FakeClock, GatedPool, TableRouter, inputs, refs, settle
from test_channel import REFS, reply_for

from experts_store import ExpertRef, Store
from server import ActorFailed, PoolSaturated
from server._settings import Settings
from server.batching import Batcher, OpenConnections
from server.kinds import MomlpModel
from server.pool import (
    ActorDied,
    ChannelServer,
    FakeExpertPool,
    Group,
    RayExpertPool,
    calls_settled,
)

pytestmark = pytest.mark.unit


async def _until(condition: Any) -> None:
    # Fake actors run on worker threads: the loop has to yield real time (bounded) to them.
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def _batcher(store: Store, pool: Any, settings: Settings, **kwargs: Any) -> Batcher:
    return Batcher(MomlpModel(TableRouter(dim=3, num_prototypes=6), refs(store)), pool, settings,
                   **kwargs)


async def test_rows_still_computing_after_their_caller_left_count_against_the_queue(
    make_store: Any,
) -> None:
    # The caller's timeout took its rows off the count while its batch still computed them:
    # the next request was admitted past max_queue_rows, and Retry-After shrank.
    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    settings = Settings(max_batch_wait_ms=0.0, max_queue_rows=4, cache_bytes=10**7)
    pool = GatedPool(FakeExpertPool(settings))
    batcher = _batcher(store, pool, settings)
    pool.gate.clear()
    left = asyncio.ensure_future(batcher.submit(inputs([0, 1, 2, 3], 3)))
    await _until(lambda: len(pool.runs) == 1)  # its batch computes (held at the pool)
    left.cancel()  # as the request's deadline does
    await asyncio.gather(left, return_exceptions=True)
    assert batcher.queued_rows == 4
    with pytest.raises(PoolSaturated) as info:
        await batcher.submit(inputs([4, 5], 3))
    assert info.value.fields["queued_rows"] == 4
    pool.gate.set()
    await _until(lambda: batcher.queued_rows == 0)  # its batch answered: the rows left
    assert (await batcher.submit(inputs([4, 5], 3))).outputs.shape == (2, 2)
    await batcher.close()
    await pool.close()


async def test_a_caller_that_leaves_before_its_batch_frees_its_rows_at_once(
    make_store: Any,
) -> None:
    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    settings = Settings(max_batch_wait_ms=0.0, max_queue_rows=6, cache_bytes=10**7)
    pool = GatedPool(FakeExpertPool(settings))
    batcher = _batcher(store, pool, settings, max_inflight_batches=1)
    pool.gate.clear()
    running = asyncio.ensure_future(batcher.submit(inputs([0, 1], 3)))
    await _until(lambda: len(pool.runs) == 1)
    queued = asyncio.ensure_future(batcher.submit(inputs([2, 3, 4], 3)))  # waits for the slot
    await settle()
    assert batcher.queued_rows == 5
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert batcher.queued_rows == 2  # never computed: nothing of it is in flight
    admitted = asyncio.ensure_future(batcher.submit(inputs([5, 5, 5, 5], 3)))
    await settle()
    assert batcher.queued_rows == 6
    pool.gate.set()
    await asyncio.gather(running, admitted)
    assert batcher.queued_rows == 0 and len(pool.runs) == 2  # the cancelled one never ran
    await batcher.close()
    await pool.close()


async def test_a_caller_that_left_frees_its_connection_for_the_batch_window(
    make_store: Any,
) -> None:
    # The window's "every open connection has a request in" follows the callers, not the
    # rows: a caller that left (504) can send again on its connection, so its rows still
    # computing must not close the next window early.
    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    settings = Settings(max_batch_wait_ms=2.0, batch_gap_ms=0.0, cache_bytes=10**7)
    connections = OpenConnections()
    connections.attach(lambda: 2)
    clock = FakeClock()
    pool = GatedPool(FakeExpertPool(settings))
    batcher = _batcher(store, pool, settings, clock=clock, sleep=clock.sleep,
                       open_connections=connections)
    pool.gate.clear()
    left = asyncio.ensure_future(batcher.submit(inputs([0], 3)))
    await settle()
    clock.advance(0.002)
    await _until(lambda: len(pool.runs) == 1)
    left.cancel()
    await asyncio.gather(left, return_exceptions=True)
    other = asyncio.ensure_future(batcher.submit(inputs([1], 3)))
    await settle()
    assert len(pool.runs) == 1  # the connection that got its 504 could still send: it waits
    clock.advance(0.002)
    pool.gate.set()
    assert (await other).queue_ms == pytest.approx(2.0)
    await batcher.close()
    await pool.close()


class _OneActorFails(FakeExpertPool):
    """actor-0's first call fails at once (its `run` raised); every other call waits for
    `release`, or, where `gated`, the n-th of them for `gates[n]`. `log` records each call's
    start and end."""

    def __init__(self, settings: Settings, *, gated: bool = False) -> None:
        super().__init__(settings)
        self.release = asyncio.Event()
        self.gates: collections.defaultdict[int, asyncio.Event] = collections.defaultdict(
            asyncio.Event
        )
        self.log: list[tuple[str, str, list[int]]] = []
        self._failed = False
        self._gated = gated
        self._waiting = itertools.count()

    async def _call_run(self, actor: str, payload: list[tuple[ExpertRef, np.ndarray]]) -> Any:
        ids = [ref.expert_id for ref, _ in payload]
        self.log.append(("start", actor, ids))
        try:
            if actor == "actor-0" and not self._failed:
                self._failed = True
                raise ActorFailed(actor=actor, reason="RuntimeError: out of memory")
            await (self.gates[next(self._waiting)] if self._gated else self.release).wait()
            return await super()._call_run(actor, payload)
        finally:
            self.log.append(("end", actor, ids))


def _one_expert_on_each(store: Store, pool: FakeExpertPool) -> tuple[int, int]:
    """An expert whose home is actor-0, and one whose home is actor-1."""
    homes = {e: pool.dispatcher.home(ref.sha256) for e, ref in enumerate(refs(store))}
    return (next(e for e, home in homes.items() if home == "actor-0"),
            next(e for e, home in homes.items() if home == "actor-1"))


def _failing_setup(
    make_store: Any, *, max_inflight_batches: int | None = None, **settings: Any
) -> tuple[_OneActorFails, int, int, Batcher]:
    """Two actors, actor-0's calls failing at once and actor-1's held at `release`; an expert
    homed on each, and a batcher over them."""
    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    config = Settings(max_batch_wait_ms=0.0, actors=2, cache_bytes=10**7, **settings)
    pool = _OneActorFails(config)
    on_0, on_1 = _one_expert_on_each(store, pool)
    extra = {} if max_inflight_batches is None else {"max_inflight_batches": max_inflight_batches}
    return pool, on_0, on_1, _batcher(store, pool, config, **extra)


async def test_a_failed_call_is_answered_at_once_though_its_siblings_still_compute(
    make_store: Any,
) -> None:
    # Waiting for every call of the batch before raising turned the 503 into a 504 whenever
    # a sibling call outlasted the request's deadline (a review of 7cc89de).
    pool, on_0, on_1, batcher = _failing_setup(make_store)
    failing = asyncio.ensure_future(batcher.submit(inputs([on_0, on_1], 3)))
    await _until(failing.done)
    with pytest.raises(ActorFailed, match="out of memory"):
        await failing
    assert ("end", "actor-1", [on_1]) not in pool.log  # still computing
    assert batcher.queued_rows == 2  # its batch holds its slot and its rows meanwhile
    pool.release.set()
    await _until(lambda: ("end", "actor-1", [on_1]) in pool.log)
    await settle()
    assert batcher.queued_rows == 0
    assert {a: pool.dispatcher.queued_rows(a) for a in pool.dispatcher.names} == {
        "actor-0": 0, "actor-1": 0
    }
    await batcher.close()
    await pool.close()


async def test_a_failed_batch_is_answered_at_once_and_keeps_its_slot_until_its_calls_end(
    make_store: Any,
) -> None:
    # Its slot was freed with the failure while its other call still computed: with one batch
    # in flight allowed, the next batch started computing beside it.
    pool, on_0, on_1, batcher = _failing_setup(make_store, max_inflight_batches=1)
    failing = asyncio.ensure_future(batcher.submit(inputs([on_0, on_1], 3)))
    await _until(failing.done)  # answered while its actor-1 call is held at `release`
    with pytest.raises(ActorFailed, match="out of memory"):
        await failing
    following = asyncio.ensure_future(batcher.submit(inputs([on_1], 3, seed=1)))
    await settle()
    assert batcher.batches == 1  # the next batch waits for the slot
    assert sorted(pool.log) == [("end", "actor-0", [on_0]), ("start", "actor-0", [on_0]),
                                ("start", "actor-1", [on_1])]
    pool.release.set()
    assert (await following).outputs.shape == (1, 2)
    # The next batch's call started once the failed batch's last call had ended.
    assert pool.log[3:] == [("end", "actor-1", [on_1]), ("start", "actor-1", [on_1]),
                            ("end", "actor-1", [on_1])]
    await batcher.close()
    await pool.close()


async def test_a_failed_batchs_rows_count_against_the_queue_until_its_calls_end(
    make_store: Any,
) -> None:
    # Its rows left the count with the failure while its other call still computed and held
    # the slot: requests were admitted past max_queue_rows behind it (no 429).
    pool, on_0, on_1, batcher = _failing_setup(make_store, max_inflight_batches=1, max_queue_rows=2)
    with pytest.raises(ActorFailed):
        await batcher.submit(inputs([on_0, on_1], 3))
    following = asyncio.ensure_future(batcher.submit(inputs([on_1], 3, seed=1)))
    await settle()
    assert following.done()  # refused, not queued behind the held slot
    with pytest.raises(PoolSaturated) as info:
        await following
    assert info.value.fields["queued_rows"] == 2
    pool.release.set()
    await _until(lambda: batcher.queued_rows == 0)
    assert (await batcher.submit(inputs([on_1, on_1], 3, seed=1))).outputs.shape == (2, 2)
    await batcher.close()
    await pool.close()


async def test_a_failed_batch_with_nothing_left_computing_frees_its_rows_as_it_answers(
    make_store: Any,
) -> None:
    pool, on_0, _, batcher = _failing_setup(make_store, max_inflight_batches=1, max_queue_rows=2)
    with pytest.raises(ActorFailed):
        await batcher.submit(inputs([on_0, on_0], 3))
    assert batcher.queued_rows == 0  # the caller, answered, can send again at once
    pool.release.set()
    assert (await batcher.submit(inputs([on_0, on_0], 3))).outputs.shape == (2, 2)
    await batcher.close()
    await pool.close()


async def test_a_failed_runs_calls_settle_once_its_other_calls_and_their_retries_end(
    make_store: Any,
) -> None:
    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    settings = Settings(actors=2, cache_bytes=10**7)
    pool = _OneActorFails(settings, gated=True)
    on_0, on_1 = _one_expert_on_each(store, pool)
    pool.kill("actor-1")  # its call dies once let through, and is retried on actor-0
    groups = [Group(refs(store)[e], inputs([e], 3)) for e in (on_0, on_1)]
    with pytest.raises(ActorFailed) as info:
        await pool.run(groups)
    settled = asyncio.ensure_future(calls_settled(info.value))
    await settle()
    assert not settled.done()  # actor-1's call is held at gates[0]
    pool.gates[0].set()
    await _until(lambda: ("start", "actor-0", [on_1]) in pool.log)  # the retry
    await settle()
    assert not settled.done()  # the retry is held at gates[1]
    pool.gates[1].set()
    await settled
    assert pool.log[-1] == ("end", "actor-0", [on_1])
    assert {a: pool.dispatcher.queued_rows(a) for a in pool.dispatcher.names} == {
        "actor-0": 0, "actor-1": 0
    }
    await calls_settled(ActorFailed(actor="*", reason="not a run's"))  # carries no calls
    await pool.close()


class _Remote:
    """A Ray method's `.remote`: each call answers with the next of `answers` (an awaitable
    maker), recording its arguments."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[Any, ...]] = []

    def options(self, **_: Any) -> _Remote:  # e.g. a probe's concurrency group
        return self

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.answer(*args)


async def test_a_late_failure_of_the_old_process_keeps_the_new_processs_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two Ray calls were in flight when the actor died; the second's RayActorError came after
    # Ray had restarted it (on this node) and a call had opened a channel to the new process.
    # It popped that channel: the next call opened another, and the first one was never
    # closed (its connection and receiver left behind by the pool's close).
    import ray
    from ray.exceptions import RayActorError

    monkeypatch.setattr(ray, "kill", lambda handle, no_restart: None)
    store = build_small_store(tmp_path / "store")
    folder = tmp_path / "channels"
    folder.mkdir()
    old_calls: list[asyncio.Future[Any]] = []

    def old_run(payload: Any) -> asyncio.Future[Any]:
        old_calls.append(asyncio.get_running_loop().create_future())
        return old_calls[-1]

    # The old process on another node (Ray calls), the restarted one on this node.
    here = ("n", str(folder / "actor-0.sock"))
    places = itertools.chain([("elsewhere", "-")], itertools.repeat(here))

    async def opened_at(directory: str) -> tuple[str, str]:
        return next(places)

    class Handle:
        run = _Remote(old_run)
        open_channel = _Remote(opened_at)

    pool = RayExpertPool({"actor-0": Handle()}, device="cpu",
                         settings=app_settings(store, actors=1), channels=folder, node_id="n")
    payload = [(REFS[0], np.zeros((1, 5), np.float32))]
    first = asyncio.ensure_future(pool._call_run("actor-0", payload))
    second = asyncio.ensure_future(pool._call_run("actor-0", payload))
    await _until(lambda: len(old_calls) == 2)
    assert pool.transport("actor-0") == "ray"  # the old process was on another node
    old_calls[0].set_exception(RayActorError())
    with pytest.raises(ActorDied):
        await first
    server = ChannelServer(folder / "actor-0.sock", reply_for)  # the restarted process
    try:
        await pool._call_run("actor-0", payload)
        assert pool.transport("actor-0") == "socket"
        old_calls[1].set_exception(RayActorError())  # the old process's late answer
        with pytest.raises(ActorDied):
            await second
        assert pool.transport("actor-0") == "socket"
        await pool._call_run("actor-0", payload)
        assert len(Handle.open_channel.calls) == 2
    finally:
        await pool.close()
        server.close()


async def test_a_late_failure_of_the_old_process_leaves_the_restarted_actor_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The old process's late RayActorError, after the restarted process had answered, was
    # one more ActorDied: the healthy actor marked dead again, and a revival started.
    import ray
    from ray.exceptions import RayActorError

    monkeypatch.setattr(ray, "kill", lambda handle, no_restart: None)
    store = build_small_store(tmp_path / "store")
    calls: list[tuple[Any, asyncio.Future[Any]]] = []

    def old_then_new_run(payload: Any) -> asyncio.Future[Any]:
        calls.append((payload, asyncio.get_running_loop().create_future()))
        return calls[-1][1]

    async def probe() -> None:
        return None  # the restarted process answers the revival's probe

    class Handle:
        run = _Remote(old_then_new_run)
        info = _Remote(probe)

    pool = RayExpertPool({"actor-0": Handle()}, device="cpu",
                         settings=app_settings(store, actors=1), channels=None, node_id="n")
    opened = Store.open(store)
    first, second = (
        asyncio.ensure_future(pool.run([Group(opened.expert_ref(e), torch.ones(1, 4))]))
        for e in (0, 1)
    )
    try:
        with caplog.at_level("WARNING", logger="server.pool._dispatch"):
            await _until(lambda: len(calls) == 2)  # both in flight when the process dies
            calls[1][1].set_exception(RayActorError())
            await _until(lambda: len(calls) == 3)  # retried on the restarted process
            calls[2][1].set_result(reply_for(calls[2][0]))
            await second
            calls[0][1].set_exception(RayActorError())  # the old process's late answer
            await _until(lambda: len(calls) == 4)
            assert pool.dispatcher.alive("actor-0")
            calls[3][1].set_result(reply_for(calls[3][0]))
            [result] = await first
        assert result.error is None and result.actor == "actor-0"
        assert caplog.text.count("actor actor-0 marked dead") == 1
        assert len(Handle.info.calls) == 1  # one revival, for the one death
    finally:
        await pool.close()
