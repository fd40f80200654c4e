"""An actor out of restarts is replaced by a new one, at most once per interval (fake pool:
the pool's clock and sleep are the test's; the real-Ray path is in test_pool.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pool_support import IdGroup, IdPool, expected

from experts_store import Store
from server import ActorFailed
from server._settings import Settings
from server.pool import ActorDied, ActorInfo, FakeExpertPool

pytestmark = pytest.mark.unit

MakeStore = Callable[..., Path]

INTERVAL_S = 600.0


class GatedTime:
    """The pool's clock and sleep: back-offs pass at once, a sleep of a minute or more (the
    wait for the next replacement) only when the test opens the gate."""

    def __init__(self) -> None:
        self.t = 0.0
        self.gate = asyncio.Event()
        self.long_sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        if seconds >= 60.0:
            self.long_sleeps.append(seconds)
            await self.gate.wait()
        self.t += seconds
        await asyncio.sleep(0)


def make_pool(store: Store, time: GatedTime, actors: int = 1) -> tuple[IdPool, FakeExpertPool]:
    settings = Settings(actors=actors, cache_bytes=10**6, actor_replace_interval_s=INTERVAL_S)
    inner = FakeExpertPool(settings, clock=time, sleep=time.sleep)
    return IdPool(store, inner), inner


async def until_alive(pool: IdPool, actor: str) -> None:
    """Wait for the pool's background revival to bring `actor` back (bounded)."""
    for _ in range(500):
        if pool.dispatcher.alive(actor):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{actor} never came back")


def one_actor(make_store: MakeStore) -> tuple[Store, GatedTime, IdPool, FakeExpertPool]:
    """A one-actor fake pool on a small store, on gated time."""
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    time = GatedTime()
    pool, inner = make_pool(store, time)
    return store, time, pool, inner


def groups_for(experts: list[int], n: int) -> list[IdGroup]:
    generator = torch.Generator().manual_seed(7)
    return [IdGroup(e, torch.randn(2, n, generator=generator)) for e in experts]


async def test_a_lone_actor_out_of_restarts_is_replaced_and_its_rows_are_answered(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    store, time, pool, inner = one_actor(make_store)
    groups = groups_for([0, 1, 2, 3], 3)
    inner.kill("actor-0", for_good=True)
    results = await asyncio.wait_for(pool.run(groups), 10)
    for group, result in zip(groups, results, strict=True):
        assert result.error is None
        torch.testing.assert_close(result.outputs, expected(store, group))
    assert inner.replacements == ["actor-0"]
    assert [actor.alive for actor in pool.actors()] == [True]
    assert "actor actor-0 is out of restarts (MOMLP_ACTOR_MAX_RESTARTS): starting a new " \
        "actor in its place" in caplog.text
    await pool.close()


async def test_a_second_death_within_the_interval_waits_for_it_then_is_replaced(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    store, time, pool, inner = one_actor(make_store)
    groups = groups_for([0, 1, 2, 3], 3)
    inner.kill("actor-0", for_good=True)
    await asyncio.wait_for(pool.run(groups), 10)
    time.t += 100.0
    inner.kill("actor-0", for_good=True)
    # Not started again at once (an actor that dies as it starts would loop): the request
    # gets its 503 now rather than waiting.
    with pytest.raises(ActorFailed):
        await asyncio.wait_for(pool.run(groups), 10)
    assert inner.replacements == ["actor-0"]
    assert [actor.alive for actor in pool.actors()] == [False]
    assert time.long_sleeps == [pytest.approx(INTERVAL_S - 100.0, abs=1.0)]  # less back-offs
    assert "out of restarts again 100 s after a new actor was started in its place; the " \
        "next starts in 500 s" in caplog.text
    time.gate.set()  # the interval has passed
    await until_alive(pool, "actor-0")
    assert inner.replacements == ["actor-0", "actor-0"]
    results = await asyncio.wait_for(pool.run(groups), 10)
    for group, result in zip(groups, results, strict=True):
        torch.testing.assert_close(result.outputs, expected(store, group))
    await pool.close()


async def test_a_replacement_that_fails_to_start_is_tried_again_after_the_interval(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    time = GatedTime()
    pool, inner = make_pool(store, time, actors=2)
    groups = groups_for([0, 1, 2, 3], 3)
    inner.failing_starts = 1
    inner.kill("actor-0", for_good=True)
    inner.kill("actor-1")  # Ray restarts this one
    await asyncio.wait_for(pool.run(groups), 10)
    assert not await asyncio.wait_for(pool.wait_until_alive("actor-0"), 10)
    assert [actor.alive for actor in pool.actors()] == [False, True]
    assert inner.replacements == ["actor-0"]
    assert "actor actor-0: no new actor in its place yet; the next try in 600 s" in caplog.text
    assert time.long_sleeps == [INTERVAL_S]
    time.gate.set()
    await until_alive(pool, "actor-0")
    assert [actor.alive for actor in pool.actors()] == [True, True]
    assert inner.replacements == ["actor-0", "actor-0"]
    await pool.close()


async def test_a_pool_closed_while_a_replacement_waits_starts_none(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    time = GatedTime()
    pool, inner = make_pool(store, time)
    inner.failing_starts = 1
    inner.kill("actor-0", for_good=True)
    with pytest.raises(ActorFailed):
        await asyncio.wait_for(pool.run(groups_for([0], 3)), 10)
    assert time.long_sleeps == [INTERVAL_S]
    await pool.close()
    time.gate.set()
    await asyncio.sleep(0.05)
    assert inner.replacements == ["actor-0"]


class LateRestart(FakeExpertPool):
    """Ray restarts the dead actor only once `back` is set (a restart waiting for room: a
    GPU or a node coming back); until then its probes fail as a restarting actor's do."""

    back = False

    async def _call_info(self, actor: str) -> ActorInfo:
        if not self.back:
            raise ActorDied(actor)
        return await super()._call_info(actor)


async def test_an_actor_back_after_its_revival_gave_up_is_found_again(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Once a revival had given up (60 s), nothing asked the actor again: restarted by Ray
    # later, it stayed dead to the pool for the server's life.
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    time = GatedTime()
    settings = Settings(actors=2, cache_bytes=10**6, actor_replace_interval_s=INTERVAL_S)
    inner = LateRestart(settings, clock=time, sleep=time.sleep)
    pool = IdPool(store, inner)
    inner._actor_lost("actor-0", "its socket closed")
    assert not await asyncio.wait_for(pool.wait_until_alive("actor-0"), 10)
    assert "actor actor-0 did not come back within 60.0 s; asked again in 600 s" in caplog.text
    assert time.long_sleeps == [INTERVAL_S]
    inner.back = True
    time.gate.set()
    await until_alive(pool, "actor-0")
    assert [actor.alive for actor in pool.actors()] == [True, True]
    assert inner.replacements == []  # restarted by its runtime, not replaced
    groups = groups_for([0, 1, 2, 3], 3)
    results = await asyncio.wait_for(pool.run(groups), 10)
    for group, result in zip(groups, results, strict=True):
        torch.testing.assert_close(result.outputs, expected(store, group))
    await pool.close()
