"""Health checks: an actor that dies while it takes no batches is noticed within a period,
and, out of restarts, replaced before any request needs it. Before, it counted as alive
(`/readyz`, `momlp_actor_alive`) until a request's call to it failed."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pool_support import IdGroup, IdPool, expected

from experts_store import Store
from server._settings import Settings
from server.pool import FakeExpertPool, RayExpertPool
from server.serving import ray_pool

MakeStore = Callable[..., Path]


async def until(predicate: Callable[[], object], *, tries: int = 500) -> None:
    """Wait for the pool's background tasks to reach a state (bounded)."""
    for _ in range(tries):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the state was never reached")


@pytest.mark.unit
async def test_an_idle_actor_gone_for_good_is_found_and_replaced_without_a_request(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    inner = FakeExpertPool(Settings(actors=2, cache_bytes=10**6))
    pool = IdPool(store, inner)
    inner._gone.add("actor-1")  # died with no call to it, its restarts spent
    assert [actor.alive for actor in pool.actors()] == [True, True]
    inner.start_health_checks(0.01)
    await until(lambda: inner.replacements == ["actor-1"] and inner.dispatcher.alive("actor-1"))
    assert "actor actor-1 failed its health check: taken for dead" in caplog.text
    assert inner.calls == []  # no request was needed
    assert pool.actors()[1].failures == {"died": 1, "hung": 0}
    await pool.close()


@pytest.mark.unit
async def test_health_checks_leave_live_actors_alone_and_stop_with_the_pool(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    inner = FakeExpertPool(Settings(actors=2, cache_bytes=10**6))
    pool = IdPool(store, inner)
    probes: list[str] = []
    real_info = inner._call_info

    async def counted(actor: str) -> object:
        probes.append(actor)
        return await real_info(actor)

    inner._call_info = counted  # type: ignore[method-assign]
    inner.start_health_checks(0.01)
    await until(lambda: len(probes) >= 6)
    assert [actor.alive for actor in pool.actors()] == [True, True]
    assert inner.replacements == [] and pool.actors()[0].failures == {"died": 0, "hung": 0}
    await pool.close()
    seen = len(probes)
    await asyncio.sleep(0.1)
    assert len(probes) == seen


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
async def test_a_killed_idle_ray_actor_out_of_restarts_is_replaced_before_a_request(
    make_store: MakeStore,
) -> None:
    # Two actors fill the session's Ray; over Ray's calls no socket tells of a death.
    store = Store.open(make_store(K=8, n=2, width=8, out=1))
    settings = Settings(
        actors=2, cache_bytes=10**7, actor_channel="ray", actor_max_restarts=0,
        actor_health_check_s=0.5,
    )
    inner = await ray_pool()(settings)  # as the server makes it: health checks on
    assert isinstance(inner, RayExpertPool)
    pool = IdPool(store, inner)
    try:
        old = inner.handle("actor-1")
        pid = await old.get_pid.remote()
        os.kill(pid, signal.SIGKILL)
        await until(lambda: inner.handle("actor-1") is not old, tries=1500)
        assert await pool.wait_until_alive("actor-1")
        assert await inner.handle("actor-1").get_pid.remote() != pid
        groups = [IdGroup(e, torch.ones(2, 2)) for e in range(8)]
        results = await pool.run(groups)
        assert {result.actor for result in results} == {"actor-0", "actor-1"}
        for group, result in zip(groups, results, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
    finally:
        await pool.close()
