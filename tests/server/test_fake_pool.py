from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pool_support import IdGroup, IdPool, expected

from experts_store import ExpertRef, ExpertTooLarge, Store
from server import ActorFailed, PoolClosed
from server._settings import Settings
from server.pool import ActorDied, ActorReply, CacheCounts, FakeExpertPool

pytestmark = pytest.mark.unit

MakeStore = Callable[..., Path]


class StepClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


async def until(predicate: Callable[[], object]) -> None:
    """Wait for the pool's tasks to reach a state (bounded; not a timing assumption)."""
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the state was never reached")


def groups_for(experts: list[int], n: int, rows: int = 2, seed: int = 0) -> list[IdGroup]:
    generator = torch.Generator().manual_seed(seed)
    return [IdGroup(e, torch.randn(rows, n, generator=generator)) for e in experts]


async def test_results_come_back_in_group_order_and_fill_the_residency_table(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=12, n=3, width=6, out=2))
    pool = IdPool(store, FakeExpertPool(Settings(actors=3, cache_bytes=10**6)))
    groups = groups_for([7, 0, 11, 3, 5], 3)
    results = await pool.run(groups)
    assert [r.expert_id for r in results] == [7, 0, 11, 3, 5]
    for group, result in zip(groups, results, strict=True):
        torch.testing.assert_close(result.outputs, expected(store, group))
        # Nothing was resident: each expert ran on its rendezvous home.
        assert result.actor == pool.dispatcher.home(group.expert_id)
    residency = pool.residency()
    holders = {e: actors[0] for e, actors in residency.items()}
    assert holders == {r.expert_id: r.actor for r in results}
    infos = {info.name: info for info in pool.actors()}
    for result in results:
        assert result.expert_id in infos[result.actor].resident
    assert all(info.alive and info.budget_bytes == 10**6 for info in infos.values())
    await pool.close()


async def test_an_actor_dying_mid_call_is_retried_elsewhere_exactly_once(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=12, n=3, width=6, out=2))
    pool = IdPool(store, FakeExpertPool(Settings(actors=3, cache_bytes=10**6)))
    groups = groups_for(list(range(12)), 3, seed=4)
    pool.kill("actor-1")
    results = await pool.run(groups)
    assert [r.expert_id for r in results] == list(range(12))
    for group, result in zip(groups, results, strict=True):
        torch.testing.assert_close(result.outputs, expected(store, group))
        assert result.actor != "actor-1"
    # Every group but actor-1's ran once; actor-1's groups were sent twice (died, retried).
    sent = Counter(e for _, ids in pool.calls for e in ids)
    pool.dispatcher.mark_alive("actor-1")
    homes = {e: pool.dispatcher.home(e) for e in range(12)}
    assert "actor-1" in homes.values()
    assert all(sent[e] == (2 if homes[e] == "actor-1" else 1) for e in range(12))
    await pool.close()


class RetryTargetDies(FakeExpertPool):
    """actor-0 dies on its first call, and so does the first call made after that death:
    the retry of actor-0's groups lands on an actor that dies as well."""

    first_died = False
    second_doomed = False

    async def _call_run(
        self, actor: str, payload: list[tuple[ExpertRef, np.ndarray]]
    ) -> ActorReply:
        if self.first_died and not self.second_doomed and actor != "actor-0":
            self.second_doomed = True
            self.kill(actor)
        try:
            return await super()._call_run(actor, payload)
        except ActorDied:
            self.first_died = True
            raise


async def test_the_retry_survives_its_own_actor_dying_too(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=12, n=3, width=6, out=2))
    pool = IdPool(store, RetryTargetDies(Settings(actors=3, cache_bytes=10**6)))
    groups = groups_for(list(range(12)), 3, seed=5)
    pool.kill("actor-0")
    results = await pool.run(groups)
    assert pool.second_doomed  # the retry's actor really died
    assert [r.expert_id for r in results] == list(range(12))
    for group, result in zip(groups, results, strict=True):
        assert result.error is None
        torch.testing.assert_close(result.outputs, expected(store, group))
    await pool.close()


async def test_a_dead_actor_comes_back_after_its_restart(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    pool = IdPool(store, FakeExpertPool(Settings(actors=2, cache_bytes=10**6)))
    pool.kill("actor-0")
    await pool.run(groups_for(list(range(8)), 3))
    for _ in range(50):  # the revival probe runs in the background
        if pool.dispatcher.alive("actor-0"):
            break
        await pool.run([])
    assert pool.dispatcher.alive("actor-0")
    await pool.close()


class LosableRuntime(FakeExpertPool):
    """A fake pool whose runtime can go away: calls to a dead actor then hang (as Ray's do
    with its GCS gone) and the runtime probe names the problem, until it comes back."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, info_timeout_s=0.02)
        self.down: str | None = None

    async def _call_info(self, actor: str) -> Any:
        while self.down is not None:
            await asyncio.sleep(1.0)
        return await super()._call_info(actor)

    async def _runtime_problem(self) -> str | None:
        return self.down


async def test_requests_stop_waiting_for_revivals_when_the_runtime_is_gone(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    runtime = LosableRuntime(Settings(actors=2, cache_bytes=10**6))
    pool = IdPool(store, runtime)
    groups = groups_for(list(range(8)), 3)
    runtime.down = "the cluster does not answer"
    pool.kill("actor-0")
    pool.kill("actor-1")
    # Both die mid-call; the revivals' calls hang; the request is answered, not held.
    with pytest.raises(ActorFailed) as caught:
        await asyncio.wait_for(pool.run(groups), 10)
    assert caught.value.fields["reason"] == "no live actor in the pool: the cluster does not answer"
    assert [actor.alive for actor in pool.actors()] == [False, False]
    with pytest.raises(ActorFailed):  # at once while it stays gone
        await asyncio.wait_for(pool.run(groups), 1)
    runtime.down = None  # back: the actors answer, and serve again
    for name in ("actor-0", "actor-1"):
        assert await asyncio.wait_for(pool.wait_until_alive(name), 10)
    results = await pool.run(groups)
    assert [r.error for r in results] == [None] * 8
    await pool.close()


async def test_a_lost_runtime_marks_idle_actors_dead_too(make_store: MakeStore) -> None:
    # /readyz reads the actors' liveness: an actor no request had called stayed "alive".
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    runtime = LosableRuntime(Settings(actors=2, cache_bytes=10**6))
    pool = IdPool(store, runtime)
    runtime.down = "the cluster does not answer"
    runtime._actor_lost("actor-1", "its socket closed")
    for _ in range(200):
        if not pool.dispatcher.alive("actor-0"):
            break
        await asyncio.sleep(0.01)
    assert [actor.alive for actor in pool.actors()] == [False, False]
    runtime.down = None
    assert await asyncio.wait_for(pool.wait_until_alive("actor-0"), 10)
    await pool.close()


async def test_prefetch_after_a_restart_loads_at_the_home_the_rows_go_to(
    make_store: MakeStore,
) -> None:
    # The survivor held every expert, so prefetch skipped them all as resident, while the
    # rows went to the restarted home, and missed there.
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    pool = IdPool(store, FakeExpertPool(Settings(actors=2, cache_bytes=10**6)))
    homed = [e for e in range(8) if pool.dispatcher.home(e) == "actor-0"]
    assert homed
    pool.kill("actor-0")
    await pool.run(groups_for(list(range(8)), 3))  # actor-0 dies mid-call; actor-1 takes all
    assert await pool.wait_until_alive("actor-0")
    assert pool.residency() == {e: ["actor-1"] for e in range(8)}
    await pool.prefetch(list(range(8)))
    await asyncio.gather(*pool._background)
    assert pool.residency() == {
        e: ["actor-0", "actor-1"] if e in homed else ["actor-1"] for e in range(8)
    }
    results = await pool.run(groups_for(homed, 3))
    # No miss: the home holds them now (held twice, the least queued of the two takes each).
    assert all(r.hit for r in results) and results[0].actor == "actor-0"
    await pool.close()


async def test_a_failed_load_is_remembered_for_a_while(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    path = store.expert_path(2)
    good_bytes = path.read_bytes()
    path.unlink()
    clock = StepClock()
    settings = Settings(actors=1, cache_bytes=10**6)
    pool = IdPool(store, FakeExpertPool(settings, clock=clock, failure_ttl_s=5))
    first = await pool.run(groups_for([1, 2], 3))
    assert first[0].error is None
    assert first[1].error is not None and first[1].error_kind == "load"
    assert first[0].retry_after_s is None and first[1].retry_after_s == 5
    path.write_bytes(good_bytes)
    calls = len(pool.calls)
    clock.t += 2
    again = await pool.run(groups_for([2], 3))
    assert again[0].error is not None and len(pool.calls) == calls
    assert again[0].retry_after_s == 3  # what is left of the memory, for Retry-After
    clock.t += 6  # the memory expires: the fixed file is read again
    [fixed] = await pool.run(groups_for([2], 3))
    assert fixed.error is None
    await pool.close()


async def test_a_failed_load_is_logged_by_the_server_once_per_memory(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Only the actor logged it, where Ray keeps its logs: 1,000 503s left no server log line.
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    store.expert_path(2).unlink()
    clock = StepClock()
    pool = IdPool(store, FakeExpertPool(Settings(actors=1), clock=clock, failure_ttl_s=5))

    def logged() -> int:
        return sum("expert 2 (" in r.getMessage() and "could not be loaded" in r.getMessage()
                   for r in caplog.records if r.levelname == "WARNING")

    with caplog.at_level("WARNING", logger="server.pool._failures"):
        for _ in range(20):
            [failed] = await pool.run(groups_for([2], 3))
            assert failed.error_kind == "load"
        assert logged() == 1
        clock.t += 6  # the memory expires, the file is read again and fails again
        await pool.run(groups_for([2], 3))
        await pool.run(groups_for([2], 3))
        assert logged() == 2
    await pool.close()


async def test_an_expert_larger_than_the_budget_is_a_startup_error(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=2, n=3, width=6, out=2))
    with pytest.raises(ExpertTooLarge) as info:
        IdPool(store, FakeExpertPool(Settings(cache_bytes=store.expert_nbytes(0) - 1)))
    assert info.value.expert_id == 0


async def test_a_closed_pool_refuses_work(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=2, n=3, width=6, out=2))
    pool = IdPool(store, FakeExpertPool(Settings()))
    await pool.close()
    with pytest.raises(PoolClosed):
        await pool.run(groups_for([0], 3))


async def test_actors_report_residency_loads_and_evictions(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=6, n=3, width=6, out=2))
    nbytes = store.expert_nbytes(0)
    settings = Settings(actors=1, cache_bytes=2 * nbytes, cache_policy="lru")
    pool = IdPool(store, FakeExpertPool(settings))
    await pool.run(groups_for([0, 1, 2, 3], 3))
    [info] = pool.actors()
    assert (info.name, info.device, info.alive) == ("actor-0", "cpu", True)
    assert info.resident == [2, 3] and info.resident_bytes == 2 * nbytes
    assert info.counts == CacheCounts(evictions=2, loads=4, load_bytes=4 * nbytes)
    assert pool.residency() == {2: ["actor-0"], 3: ["actor-0"]}
    await pool.close()


async def test_a_single_actor_that_dies_is_retried_once_restarted(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    pool = IdPool(store, FakeExpertPool(Settings(actors=1, cache_bytes=10**6)))
    groups = groups_for([0, 1, 2, 3], 3)
    pool.kill("actor-0")
    results = await pool.run(groups)
    for group, result in zip(groups, results, strict=True):
        torch.testing.assert_close(result.outputs, expected(store, group))
    assert [ids for _, ids in pool.calls] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert pool.dispatcher.alive("actor-0")
    await pool.close()


async def test_prefetch_warms_each_expert_on_its_home_actor(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    pool = IdPool(store, FakeExpertPool(Settings(actors=2, cache_bytes=10**6)))
    await pool.prefetch([1, 6, 1])
    await asyncio.gather(*pool._background)  # prefetch returns at once; let it finish
    homes = {e: pool.dispatcher.home(e) for e in (1, 6)}
    assert pool.residency() == {e: [actor] for e, actor in homes.items()}
    results = await pool.run(groups_for([1, 6], 3))
    assert all(r.hit and r.actor == homes[r.expert_id] for r in results)
    await pool.close()


class SlowRestart(FakeExpertPool):
    """A fake pool whose dead actors take long to restart: their probes wait for `restarted`."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.restarted = asyncio.Event()

    async def _call_info(self, actor: str) -> Any:
        await self.restarted.wait()
        return await super()._call_info(actor)


async def test_a_pool_closed_while_a_batch_waits_for_a_revival_answers_pool_closed(
    make_store: MakeStore,
) -> None:
    # The close ended the revival the batch waited for, and the batch then found no live
    # actor: 503 actor_failed ("no live actor in the pool") where every other call during a
    # close gets PoolClosed (503 not_ready).
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    pool = IdPool(store, SlowRestart(Settings(actors=1, cache_bytes=10**6)))
    pool.kill("actor-0")
    batch = asyncio.ensure_future(pool.run(groups_for([0, 1], 3)))
    # The call dies; the batch then waits for the restart.
    await until(lambda: not pool.dispatcher.alive("actor-0"))
    assert not pool.dispatcher.alive("actor-0") and not batch.done()
    await pool.close()
    with pytest.raises(PoolClosed):
        await batch


class LateOldProcessFailure(FakeExpertPool):
    """actor-0's first call is in flight when its process dies, and Ray tells so only after
    the actor restarted (as it may, for an old process's second call in flight)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.in_flight: asyncio.Future[None] | None = None

    async def _call_run(
        self, actor: str, payload: list[tuple[ExpertRef, np.ndarray]]
    ) -> ActorReply:
        if actor == "actor-0" and self.in_flight is None:
            self.in_flight = asyncio.get_running_loop().create_future()
            await self.in_flight
            raise ActorDied(actor)
        return await super()._call_run(actor, payload)


async def test_a_late_failure_of_a_restarted_actors_old_process_leaves_it_alive(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # The late failure marked the restarted, healthy actor dead again: its cache table
    # dropped, a revival started, and the call's groups were retried on another actor.
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    pool = IdPool(store, LateOldProcessFailure(Settings(actors=2, cache_bytes=10**6)))
    homed = [e for e in range(8) if pool.dispatcher.home(e) == "actor-0"]
    assert homed
    with caplog.at_level("WARNING", logger="server.pool._dispatch"):
        first = asyncio.ensure_future(pool.run(groups_for(homed, 3)))
        await until(lambda: pool.inner.in_flight is not None)
        pool.kill("actor-0")  # the process dies: the next call notices
        second = await pool.run(groups_for(homed, 3, seed=1))
        assert pool.calls[0][0] == "actor-0"  # where the second batch found it dead
        assert {r.actor for r in second} == {"actor-1"}
        assert await pool.wait_until_alive("actor-0")  # restarted, and it answered
        pool.inner.in_flight.set_result(None)  # the old process's call fails only now
        results = await first
    assert pool.dispatcher.alive("actor-0")
    assert [r.error for r in results] == [None] * len(homed)
    assert {r.actor for r in results} == {"actor-0"}  # retried on its restarted home
    for group, result in zip(groups_for(homed, 3), results, strict=True):
        torch.testing.assert_close(result.outputs, expected(store, group))
    assert caplog.text.count("actor actor-0 marked dead") == 1
    await pool.close()


async def test_a_late_failure_of_the_old_process_does_not_use_up_a_retry(
    make_store: MakeStore,
) -> None:
    # The stale failure took one of the two retries: when both actors then died under the
    # retried call, the batch failed with 503 actor_failed ("died again during the
    # retries"), though two deaths close together are what the retries are there for.
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    pool = IdPool(store, LateOldProcessFailure(Settings(actors=2, cache_bytes=10**6)))
    homed = [e for e in range(8) if pool.dispatcher.home(e) == "actor-0"]
    assert homed
    first = asyncio.ensure_future(pool.run(groups_for(homed, 3)))
    await until(lambda: pool.inner.in_flight is not None)
    pool.kill("actor-0")
    await pool.run(groups_for(homed, 3, seed=1))  # finds actor-0 dead: restarted
    assert await pool.wait_until_alive("actor-0")
    pool.kill("actor-0")  # the retried call's actor dies,
    pool.kill("actor-1")  # and so does the one it is retried on next
    pool.inner.in_flight.set_result(None)  # the old process's call fails only now
    results = await first
    assert [r.error for r in results] == [None] * len(homed)
    for group, result in zip(groups_for(homed, 3), results, strict=True):
        torch.testing.assert_close(result.outputs, expected(store, group))
    assert [actor for actor, _ in pool.calls[-3:-1]] == ["actor-0", "actor-1"]
    await pool.close()


async def test_an_actors_load_counts_only_grow_across_its_restart(make_store: MakeStore) -> None:
    # The pool showed the dead process's counts until the new process replied, then the new
    # one's: having loaded as much again, the series read 3 -> 3 and Prometheus saw no loads.
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    pool = IdPool(store, FakeExpertPool(Settings(actors=2, cache_bytes=10**6)))
    homed = [e for e in range(8) if pool.dispatcher.home(e) == "actor-0"]
    assert homed

    def loads() -> int:
        return next(a.counts.loads for a in pool.actors() if a.name == "actor-0")

    await pool.run(groups_for(homed, 3))
    first = loads()
    assert first == len(homed)
    pool.kill("actor-0")
    await pool.run(groups_for(homed, 3, seed=1))  # dies mid-call: retried on actor-1
    assert loads() == first  # what the dead process had told, not dropped
    assert await pool.wait_until_alive("actor-0")
    await pool.run(groups_for(homed, 3, seed=2))  # the new process loads them all again
    assert loads() == 2 * first
    await pool.close()


class SlowSecondCall(FakeExpertPool):
    """actor-0's second call waits for the test before it runs (and then answers)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.gate: asyncio.Future[None] | None = None
        self.seen = 0

    async def _call_run(
        self, actor: str, payload: list[tuple[ExpertRef, np.ndarray]]
    ) -> ActorReply:
        if actor == "actor-0":
            self.seen += 1
            if self.seen == 2:
                self.gate = asyncio.get_running_loop().create_future()
                await self.gate
        return await super()._call_run(actor, payload)


async def test_a_reply_of_a_process_already_dead_does_not_count_its_loads_twice(
    make_store: MakeStore,
) -> None:
    # Its counts were added in when its death was noticed; taken again as the current
    # process's, the actor's loads read twice what were done.
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    pool = IdPool(store, SlowSecondCall(Settings(actors=2, cache_bytes=10**6)))
    homed = [e for e in range(8) if pool.dispatcher.home(e) == "actor-0"]
    assert homed

    def loads() -> int:
        return next(a.counts.loads for a in pool.actors() if a.name == "actor-0")

    await pool.run(groups_for(homed, 3))
    first = loads()
    assert first == len(homed)
    call = asyncio.ensure_future(pool.run(groups_for(homed, 3, seed=1)))  # hits only
    await until(lambda: pool.inner.gate is not None)
    pool.inner._actor_lost("actor-0", "its socket closed")  # noticed before the reply
    pool.inner.gate.set_result(None)
    await call
    assert loads() == first
    await pool.close()


class NeverBack(FakeExpertPool):
    """A fake pool whose runtime never restarts a dead actor, though it says it will."""

    async def _call_info(self, actor: str) -> Any:
        raise ActorDied(actor)


async def test_a_revival_backs_off_on_the_pools_sleep_and_gives_up_after_its_timeout(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # The back-off slept on asyncio.sleep, not the pool's: a test of a revival that gives up
    # had to wait out its 60 s.
    slept: list[float] = []
    clock = StepClock()
    later = asyncio.Event()  # never set: the next revival, after the interval, waits

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if seconds >= 60.0:
            await later.wait()
        clock.t += seconds
        await asyncio.sleep(0)

    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    pool = IdPool(
        store, NeverBack(Settings(actors=2, cache_bytes=10**6), clock=clock, sleep=sleep)
    )
    pool.inner._actor_lost("actor-0", "its socket closed")
    with caplog.at_level("ERROR", logger="server.pool._revival"):
        assert not await asyncio.wait_for(pool.wait_until_alive("actor-0"), 10)
    assert slept[:7] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    backoffs = slept[:-1]  # the last: the wait before it is asked again
    assert sum(backoffs) >= 60.0 and sum(backoffs[:-1]) < 60.0
    assert slept[-1] == 60.0
    assert "actor actor-0 did not come back within 60.0 s; asked again in 60 s" in caplog.text
    assert [a.alive for a in pool.actors()] == [False, True]
    await pool.close()


class SlowNeverBack(NeverBack):
    """Each question to the dead actor fails only after 20 s (as one hanging up to its
    timeout does), on the pool's clock."""

    def __init__(self, settings: Settings, clock: StepClock, **kwargs: Any) -> None:
        super().__init__(settings, clock=clock, **kwargs)
        self.step_clock = clock
        self.asked = 0

    async def _call_info(self, actor: str) -> Any:
        self.asked += 1
        self.step_clock.t += 20.0
        return await super()._call_info(actor)


async def test_a_revival_gives_up_after_its_timeout_by_the_clock_when_each_call_is_slow(
    make_store: MakeStore,
) -> None:
    # The timeout summed the back-off's sleeps only: with calls that each took 20 s to fail,
    # the revival asked 66 times (over 22 minutes) before giving up on its 60 s.
    clock = StepClock()
    later = asyncio.Event()  # never set: the next revival, after the interval, waits

    async def sleep(seconds: float) -> None:
        if seconds >= 60.0:
            await later.wait()
        clock.t += seconds
        await asyncio.sleep(0)

    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    inner = SlowNeverBack(Settings(actors=2, cache_bytes=10**6), clock, sleep=sleep)
    pool = IdPool(store, inner)
    pool.inner._actor_lost("actor-0", "its socket closed")
    assert not await asyncio.wait_for(pool.wait_until_alive("actor-0"), 10)
    assert inner.asked == 3 and clock.t < 60.0 + 20.0 + 1.0
    await pool.close()
