"""An actor that hangs without dying (a read stuck on a network filesystem, a deadlock, a
SIGSTOP): past `actor_call_timeout_s` its call is given up, its process killed for Ray to
restart, and its rows answered by another actor. Before, nothing bounded such a call: each
batch that touched the actor held an in-flight slot for good, until the server answered
nothing while /readyz said ready."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
from app_support import fake_app, running
from pool_support import IdGroup, IdPool, expected

import server.pool._kill
from experts_store import MonotonicClock, Store
from server import ActorFailed, PoolClosed
from server._settings import Settings
from server.pool import FakeExpertPool, RayExpertPool, calls_settled
from server.pool._kill import kill_hung_process

MakeStore = Callable[..., Path]


def groups_for(experts: list[int], n: int, seed: int = 0) -> list[IdGroup]:
    generator = torch.Generator().manual_seed(seed)
    return [IdGroup(e, torch.randn(2, n, generator=generator)) for e in experts]


def assert_answered(store: Store, groups: list[IdGroup], results: list[Any]) -> None:
    assert [r.expert_id for r in results] == [g.expert_id for g in groups]
    for group, result in zip(groups, results, strict=True):
        assert result.error is None
        torch.testing.assert_close(result.outputs, expected(store, group))


@pytest.mark.unit
async def test_a_hung_call_is_given_up_its_rows_answered_elsewhere_and_its_actor_revived(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store.open(make_store(K=12, n=3, width=6, out=2))
    fake = FakeExpertPool(Settings(actors=3, cache_bytes=10**6, actor_call_timeout_s=2.0))
    pool = IdPool(store, fake)
    groups = groups_for(list(range(12)), 3, seed=7)
    homes = {r.expert_id: r.actor for r in await pool.run(groups)}  # warm: calls take ms
    assert "actor-1" in homes.values()
    fake.calls.clear()
    pool.hang("actor-1")
    # Bounded only so that the old code fails rather than hangs: it never answered.
    results = await asyncio.wait_for(pool.run(groups), 60)
    assert_answered(store, groups, results)
    assert all(r.actor != "actor-1" for r in results)
    # actor-1's groups went twice (given up, retried elsewhere), every other group once:
    # the hung call was answered by no one, its retry once.
    sent = Counter(e for _, ids in fake.calls for e in ids)
    assert sent == {e: 2 if homes[e] == "actor-1" else 1 for e in range(12)}
    assert fake.hung_kills == ["actor-1"]
    assert caplog.text.count("actor actor-1 did not answer within 2 s") == 1
    # Counted by cause, once for the hang (not again for the stale calls it failed).
    assert {a.name: a.failures for a in fake.actors()} == {
        "actor-0": {"died": 0, "hung": 0},
        "actor-1": {"died": 0, "hung": 1},
        "actor-2": {"died": 0, "hung": 0},
    }
    # Marked dead at once, and revived once its process was killed and restarted.
    assert await asyncio.wait_for(pool.wait_until_alive("actor-1"), 60)
    again = await pool.run(groups)
    assert_answered(store, groups, again)
    assert {r.expert_id: r.actor for r in again} == homes  # its experts went home again
    await pool.close()


@pytest.mark.unit
async def test_a_lone_hung_actor_answers_its_batch_once_restarted(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    fake = FakeExpertPool(Settings(actors=1, cache_bytes=10**6, actor_call_timeout_s=2.0))
    pool = IdPool(store, fake)
    groups = groups_for([0, 1, 2, 3], 3)
    pool.hang("actor-0")
    results = await asyncio.wait_for(pool.run(groups), 60)
    assert_answered(store, groups, results)
    assert fake.hung_kills == ["actor-0"] and [a.alive for a in pool.actors()] == [True]
    await pool.close()


@pytest.mark.unit
async def test_closing_the_pool_ends_a_call_its_hung_actor_holds(make_store: MakeStore) -> None:
    # The Ray pool's close kills the processes, and a call a hung one held fails at once (its
    # socket closes). The fake's held it to its deadline (120 s here): a run pending past the
    # close, and a batch waiting out its calls (`calls_settled`) left running past the loop.
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    fake = FakeExpertPool(Settings(actors=1, cache_bytes=10**6))
    pool = IdPool(store, fake)
    pool.hang("actor-0")
    running = asyncio.ensure_future(pool.run(groups_for([0, 1], 3)))
    for _ in range(500):  # bounded wait for the call to reach the hung actor
        if fake.calls:
            break
        await asyncio.sleep(0.01)
    assert fake.calls and not running.done()
    await pool.close()
    with pytest.raises(PoolClosed):
        # Bounded only so that the old code fails rather than waits out the deadline.
        await asyncio.wait_for(running, 30)
    assert fake.hung_kills == []  # a close is no hang: nothing taken for hung, no error


class EveryProcessHangs(FakeExpertPool):
    """Each restarted process of a hung actor hangs again."""

    async def _kill_hung(self, actor: str) -> None:
        await super()._kill_hung(actor)
        self.hang(actor)


@pytest.mark.unit
async def test_a_hang_uses_a_retry_as_a_death_does(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    fake = EveryProcessHangs(Settings(actors=1, cache_bytes=10**6, actor_call_timeout_s=0.2))
    pool = IdPool(store, fake)
    pool.hang("actor-0")
    with pytest.raises(ActorFailed) as caught:
        await asyncio.wait_for(pool.run(groups_for([0, 1], 3)), 60)
    assert caught.value.fields["reason"] == "hung again during the retries"
    await calls_settled(caught.value)  # nothing of the batch left running
    assert fake.hung_kills == ["actor-0"] * 3  # the first try and its two retries
    await pool.close()


@pytest.mark.unit
async def test_a_hang_no_caller_waits_for_is_killed_once_and_not_retried(
    make_store: MakeStore,
) -> None:
    # Rows that hang every process they reach (a file on a hung mount): each retry hung and
    # killed again, three kills a call, for rows whose requests had their 504 long before.
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    fake = EveryProcessHangs(Settings(actors=2, cache_bytes=10**6, actor_call_timeout_s=0.2))
    pool = IdPool(store, fake)
    pool.hang("actor-0")
    pool.hang("actor-1")
    with pytest.raises(ActorFailed) as caught:
        await asyncio.wait_for(pool.run(groups_for([0, 1, 2, 3], 3), wanted=lambda: False), 60)
    assert caught.value.fields["reason"] == "hung mid-call; not retried: no request waits for it"
    await calls_settled(caught.value)
    # Each hung call's actor still killed (for Ray to restart), once: no retry hung again.
    called = [actor for actor, _ in fake.calls]
    assert len(called) == len(set(called))  # one call an actor: nothing retried
    assert sorted(fake.hung_kills) == sorted(called)
    await pool.close()


@pytest.mark.unit
async def test_a_death_while_a_caller_waits_is_still_retried(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    fake = FakeExpertPool(Settings(actors=2, cache_bytes=10**6, actor_call_timeout_s=0.5))
    pool = IdPool(store, fake)
    groups = groups_for([0, 1, 2, 3], 3)
    asked: list[bool] = []

    def wanted() -> bool:
        asked.append(True)
        return True

    pool.hang("actor-0")
    results = await asyncio.wait_for(pool.run(groups, wanted=wanted), 60)
    assert_answered(store, groups, results)
    assert asked  # consulted at the hang, and the answer let the retry run


@pytest.mark.unit
async def test_a_retry_that_waited_for_a_revival_is_dropped_once_no_one_waits(
    make_store: MakeStore,
) -> None:
    # A lone actor's retry waits for its restart (or replacement: up to its start timeout);
    # the requests may all have had their 504 by then.
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    fake = FakeExpertPool(Settings(actors=1, cache_bytes=10**6))
    pool = IdPool(store, fake)
    answers = iter([True, False])  # waited for at the death, no longer after the revival
    fake.kill("actor-0")
    with pytest.raises(ActorFailed) as caught:
        await asyncio.wait_for(
            pool.run(groups_for([0, 1], 3), wanted=lambda: next(answers)), 60
        )
    assert caught.value.fields["reason"] == "died mid-call; not retried: no request waits for it"
    assert [actor for actor, _ in fake.calls] == ["actor-0"]  # the retry never ran
    await pool.close()


@pytest.mark.unit
async def test_a_batch_whose_requests_timed_out_frees_its_slot_after_one_kill(
    make_store: MakeStore,
) -> None:
    # The user-visible side: with the default deadlines (a request's 504 before the actor's
    # call deadline), a hang the rows cause killed the lone actor three times, each after a
    # full deadline, and held the batch's in-flight slot all that while.
    store = make_store(K=8, n=4, width=16, out=2)
    app = fake_app(store, actors=1, actor_call_timeout_s=1.0, request_timeout_s=0.3)
    rows = np.random.default_rng(3).uniform(-1, 1, (8, 4)).tolist()
    async with running(app) as client:
        pool = app.state.serving.pool
        kill_hung = pool._kill_hung

        async def hangs_again(actor: str) -> None:  # as EveryProcessHangs
            await kill_hung(actor)
            pool.hang(actor)

        pool._kill_hung = hangs_again
        pool.hang("actor-0")
        timed_out = await asyncio.wait_for(client.post("/v1/predict", json={"inputs": rows}), 60)
        assert timed_out.status_code == 504
        batcher = app.state.serving.current().batcher
        for _ in range(1000):  # bounded wait for the batch's end (the old code's: ~3 s)
            if pool.hung_kills and batcher.queued_rows == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.hung_kills == ["actor-0"]
        assert batcher.queued_rows == 0


@pytest.mark.unit
async def test_a_hung_prefetch_is_given_up(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    fake = FakeExpertPool(Settings(actors=2, cache_bytes=10**6, actor_call_timeout_s=0.2))
    pool = IdPool(store, fake)

    async def prefetch_hangs(actor: str, experts: Any) -> dict[str, int]:
        await asyncio.Event().wait()  # as the hung process's run does
        raise AssertionError("unreachable")

    fake._call_prefetch = prefetch_hangs  # type: ignore[method-assign]
    await pool.prefetch(list(range(8)))
    for _ in range(500):  # bounded wait for the background calls: they end at their deadline
        if not fake._background:
            break
        await asyncio.sleep(0.01)
    assert not fake._background
    await pool.close()


class _Remote:
    def __init__(self, answer: Callable[[], Any]) -> None:
        self._answer = answer

    def remote(self) -> Any:
        return self._answer()


@pytest.mark.unit
@pytest.mark.parametrize("answers", [True, False])
async def test_the_revival_waits_until_the_killed_process_answers_no_more(
    monkeypatch: pytest.MonkeyPatch, answers: bool
) -> None:
    # A process hung in one thread (a deadlock) answers other calls until Ray's kill lands;
    # a stopped one answers none.
    events: list[Any] = []
    pids = iter([41, 41, 41, 42])

    async def get_pid() -> int:
        if not answers:
            await asyncio.Event().wait()
        events.append("probe")
        return next(pids)

    class Handle:
        pass

    handle = Handle()
    handle.get_pid = _Remote(get_pid)  # type: ignore[attr-defined]
    import ray

    monkeypatch.setattr(ray, "kill", lambda h, no_restart: events.append(("kill", no_restart)))
    monkeypatch.setattr(server.pool._kill, "PROBE_S", 0.05)

    async def no_wait(_: float) -> None:
        await asyncio.sleep(0)

    await kill_hung_process("actor-0", handle, clock=MonotonicClock(), sleep=no_wait)
    if answers:  # killed once, then returned only once another process answered
        assert events == ["probe", ("kill", False), "probe", "probe", "probe"]
    else:
        assert events == [("kill", False)]


def _stopped(pid: int) -> bool:
    """Whether `pid` is a stopped process (state T), as SIGSTOP left it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("channel", ["socket", "ray"])
async def test_a_stopped_actor_process_is_killed_restarted_and_its_rows_answered(
    make_store: MakeStore, channel: Literal["socket", "ray"], caplog: pytest.LogCaptureFixture
) -> None:
    # The deployment's shape: two actors take both CPUs of the session's Ray, so the
    # restart needs the CPU the killed process held.
    store = Store.open(make_store(K=12, n=3, width=8, out=2))
    settings = Settings(
        actors=2, cache_bytes=10**7, actor_channel=channel, actor_call_timeout_s=5.0
    )
    pool = IdPool(store, await asyncio.to_thread(RayExpertPool.create, settings))
    groups = groups_for(list(range(12)), 3, seed=3)
    pid: int | None = None
    try:
        homes = {r.expert_id: r.actor for r in await pool.run(groups)}
        assert set(homes.values()) == {"actor-0", "actor-1"}
        assert pool.transport("actor-0") == channel
        pid = await pool.handle("actor-0").get_pid.remote()
        os.kill(pid, signal.SIGSTOP)
        batches = [groups_for(list(range(12)), 3, seed=seed) for seed in range(6)]
        # Bounded only so that the old code fails rather than hangs: it never answered.
        answers = await asyncio.wait_for(asyncio.gather(*(pool.run(b) for b in batches)), 90)
        for batch, results in zip(batches, answers, strict=True):
            assert_answered(store, batch, results)
        assert caplog.text.count("actor actor-0 did not answer within 5 s") == 1
        # Ray killed the stopped process and started another, which serves its experts.
        assert await pool.wait_until_alive("actor-0")
        assert await pool.handle("actor-0").get_pid.remote() != pid
        assert not _stopped(pid)
        again = await pool.run(groups)
        assert_answered(store, groups, again)
        assert {r.expert_id: r.actor for r in again} == homes
        assert pool.transport("actor-0") == channel
    finally:
        if pid is not None and _stopped(pid):
            os.kill(pid, signal.SIGKILL)  # never leave a stopped Ray worker behind
        await pool.close()


@pytest.mark.unit
async def test_metrics_count_each_actors_hangs_and_deaths_by_cause(make_store: MakeStore) -> None:
    # An operator could see a hang only in the log: nothing to alert on before the restarts
    # ran out.
    store = make_store(K=8, n=4, width=16, out=2)
    app = fake_app(store, actors=2, actor_call_timeout_s=2.0)
    rows = np.random.default_rng(3).uniform(-1, 1, (64, 4)).tolist()
    async with running(app) as client:
        pool = app.state.serving.pool
        assert (await client.post("/v1/predict", json={"inputs": rows})).status_code == 200
        pool.hang("actor-1")
        answered = await asyncio.wait_for(client.post("/v1/predict", json={"inputs": rows}), 60)
        assert answered.status_code == 200
        pool.kill("actor-0")  # a death: noticed at its next call
        assert (await client.post("/v1/predict", json={"inputs": rows})).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert pool.hung_kills == ["actor-1"]
    assert 'momlp_actor_failures_total{actor="actor-1",cause="hung"} 1.0' in metrics
    assert 'momlp_actor_failures_total{actor="actor-1",cause="died"} 0.0' in metrics
    assert 'momlp_actor_failures_total{actor="actor-0",cause="died"} 1.0' in metrics
    assert 'momlp_actor_failures_total{actor="actor-0",cause="hung"} 0.0' in metrics
