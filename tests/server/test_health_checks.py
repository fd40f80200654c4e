"""Health checks: an actor that dies while it takes no batches is noticed within a period,
and, out of restarts, replaced before any request needs it. Before, it counted as alive
(`/readyz`, `momlp_actor_alive`) until a request's call to it failed."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
from app_support import app_settings, running
from pool_support import IdGroup, IdPool, expected

from experts_store import ExpertRef, Store
from server import create_app
from server._settings import Settings
from server.pool import ActorInfo, Dispatcher, FakeExpertPool, RayExpertPool
from server.pool._health import check_health
from server.serving import ray_pool

MakeStore = Callable[..., Path]


async def until(predicate: Callable[[], object], *, tries: int = 500) -> None:
    """Wait for the pool's background tasks to reach a state (bounded)."""
    for _ in range(tries):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the state was never reached")


async def restarted(handle: Any, pid: int) -> int:
    """Wait until Ray has restarted the actor of `handle` (another pid answers); bounded."""
    from ray.exceptions import RayActorError

    for _ in range(600):
        try:
            answer: int = await handle.get_pid.remote()
        except RayActorError:  # restarting
            answer = pid
        if answer != pid:
            return answer
        await asyncio.sleep(0.1)
    raise AssertionError("the actor was never restarted")


def before_probes(inner: FakeExpertPool, before: Callable[[str], Awaitable[None]]) -> None:
    """Each of `inner`'s probes awaits `before(actor)` first."""
    real_info = inner._call_info

    async def probe(actor: str) -> ActorInfo:
        await before(actor)
        return await real_info(actor)

    inner._call_info = probe  # type: ignore[method-assign]


def record_probes(inner: FakeExpertPool) -> list[str]:
    """The actors `inner`'s health checks probe, in order, as they probe them."""
    probed: list[str] = []

    async def count(actor: str) -> None:
        probed.append(actor)

    before_probes(inner, count)
    return probed


def probed_pool(
    make_store: MakeStore, experts: int, actors: int, before: Callable[[str], Awaitable[None]]
) -> tuple[Store, FakeExpertPool, IdPool, list[str]]:
    """A fake pool of `actors` whose probes time out at 0.05 s and await `before(actor)`
    first, on a store of `experts`, and the actors it probes, in order."""
    store = Store.open(make_store(K=experts, n=3, width=6, out=2))
    inner = FakeExpertPool(Settings(actors=actors, cache_bytes=10**6), info_timeout_s=0.05)
    before_probes(inner, before)
    return store, inner, IdPool(store, inner), record_probes(inner)


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
    probes = record_probes(inner)
    inner.start_health_checks(0.01)
    await until(lambda: len(probes) >= 6)
    assert [actor.alive for actor in pool.actors()] == [True, True]
    assert inner.replacements == [] and pool.actors()[0].failures == {"died": 0, "hung": 0}
    await pool.close()
    seen = len(probes)
    await asyncio.sleep(0.1)
    assert len(probes) == seen


@pytest.mark.unit
async def test_an_idle_actor_restarted_unseen_between_two_probes_is_counted_and_its_table_dropped(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Ray restarts an actor within seconds, mostly between two probes (10 s apart): each
    # probe answered, so its death went uncounted and its dead process's experts stayed
    # listed as resident (/v1/experts, prefetch skipped them).
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    inner = FakeExpertPool(Settings(actors=2, cache_bytes=10**6))
    pool = IdPool(store, inner)
    await pool.run([IdGroup(e, torch.ones(2, 3)) for e in range(4)])
    assert pool.actors()[1].resident
    probed = record_probes(inner)
    inner.start_health_checks(0.01)
    try:
        await until(lambda: probed.count("actor-1") >= 2)  # its process known to the checks
        await inner._restart("actor-1")  # no call, no socket: nothing but a probe can tell
        await until(lambda: pool.actors()[1].failures == {"died": 1, "hung": 0})
        assert "actor actor-1 answered its health check from a new process" in caplog.text
        await until(lambda: inner.dispatcher.alive("actor-1"))
        assert pool.actors()[1].resident == []
        assert pool.actors()[0].failures == {"died": 0, "hung": 0}
        seen = len(probed)
        await until(lambda: len(probed) >= seen + 6)  # the new process probed again, alive
        assert pool.actors()[1].failures == {"died": 1, "hung": 0}
    finally:
        await pool.close()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
async def test_a_killed_idle_ray_actor_restarted_between_two_probes_is_counted(
    make_store: MakeStore,
) -> None:
    # Two actors fill the session's Ray; batches go as Ray calls (as to an actor on another
    # node), so no socket tells of the death. Ray's restart (~3 s here) is held to fall
    # between two probes, as it mostly does 10 s apart: the probes meanwhile wait and time
    # out (as a busy actor's do), which says nothing.
    store = Store.open(make_store(K=8, n=2, width=8, out=1))
    settings = Settings(actors=2, cache_bytes=10**7, actor_channel="ray")
    inner = await asyncio.to_thread(RayExpertPool.create, settings)
    pool = IdPool(store, inner)
    answered: list[str] = []
    held = asyncio.Event()
    held.set()
    real_info = inner._call_info

    async def gated(actor: str) -> ActorInfo:
        await held.wait()
        info = await real_info(actor)
        answered.append(actor)
        return info

    inner._call_info = gated  # type: ignore[method-assign]
    try:
        await pool.run([IdGroup(e, torch.ones(2, 2)) for e in range(8)])
        assert pool.actors()[1].resident
        inner.start_health_checks(0.2)
        await until(lambda: "actor-1" in answered)  # its first process known to the checks
        held.clear()
        pid = await inner.handle("actor-1").get_pid.remote()
        os.kill(pid, signal.SIGKILL)
        new_pid = await restarted(inner.handle("actor-1"), pid)
        held.set()
        await until(lambda: pool.actors()[1].failures == {"died": 1, "hung": 0}, tries=1500)
        assert await pool.wait_until_alive("actor-1")
        assert pool.actors()[1].resident == []  # the dead process's experts are not listed
        assert await inner.handle("actor-1").get_pid.remote() == new_pid
        groups = [IdGroup(e, torch.ones(2, 2)) for e in range(8)]
        for group, result in zip(groups, await pool.run(groups), strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert pool.actors()[0].failures == {"died": 0, "hung": 0}
    finally:
        await pool.close()


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
    made = ray_pool()(settings)  # as the server makes it: health checks on
    inner = await made if inspect.isawaitable(made) else made
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


@pytest.mark.unit
async def test_a_frozen_idle_actor_is_taken_for_hung_once_it_answers_nothing_long_enough(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # A stopped process was found only by a call's deadline (120 s), while /readyz said
    # ready and every batch with rows on it held an in-flight slot.
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    inner = FakeExpertPool(Settings(actors=2, cache_bytes=10**6), info_timeout_s=0.05)
    pool = IdPool(store, inner)
    inner.hang("actor-1", frozen=True)
    inner.start_health_checks(0.01, unresponsive_s=0.3)
    try:
        await until(lambda: inner.hung_kills == ["actor-1"])
        assert "actor actor-1 answered no health check and no call for 0.3 s" in caplog.text
        await until(lambda: inner.dispatcher.alive("actor-1"))  # restarted, and back
        assert [a.failures for a in pool.actors()] == [
            {"died": 0, "hung": 0}, {"died": 0, "hung": 1},
        ]
        groups = [IdGroup(e, torch.ones(2, 3)) for e in range(4)]
        for group, result in zip(groups, await pool.run(groups), strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
    finally:
        await pool.close()


@pytest.mark.unit
async def test_rows_on_a_frozen_actor_are_answered_at_its_first_unanswered_probe_not_its_kill(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # They waited for its kill (15 s with the defaults), and every batch with rows on it held
    # an in-flight slot meanwhile: the whole server stalled.
    store = Store.open(make_store(K=8, n=3, width=6, out=2))
    settings = Settings(actors=2, cache_bytes=10**6, actor_call_timeout_s=120.0)
    inner = FakeExpertPool(settings, info_timeout_s=0.05)
    pool = IdPool(store, inner)
    groups = [IdGroup(e, torch.randn(2, 3)) for e in range(8)]
    homes = {r.actor for r in await pool.run(groups)}
    assert homes == {"actor-0", "actor-1"}
    inner.start_health_checks(0.01, unresponsive_s=60.0)
    inner.hang("actor-0", frozen=True)
    try:
        # Bounded far below the kill and the call deadline, which the batch waited out.
        results = await asyncio.wait_for(pool.run(groups), 20)
        for group, result in zip(groups, results, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert {r.actor for r in results} == {"actor-1"}
        assert "actor actor-0 answered no health check in 0.05 s: 1 of its calls given up" \
            in caplog.text
        # Alive (not killed: the kill waits for unresponsive_s), and left out while it is silent.
        assert inner.hung_kills == []
        assert [a.alive for a in pool.actors()] == [True, True]
        sent = len(inner.calls)
        await asyncio.wait_for(pool.run(groups), 20)
        assert {actor for actor, _ in inner.calls[sent:]} == {"actor-1"}
    finally:
        await pool.close()


class PausablePool(FakeExpertPool):
    """Actors whose calls and probes can be held, as a stopped process's are, and let go on
    (SIGCONT); a held call's reply, when it comes, is the one it would have had."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paused: dict[str, asyncio.Event] = {}
        self.sent: list[str] = []  # the actor of each run call, as it is sent
        self.held_probes = 0  # probes waiting on a paused actor now
        # Actor -> set once its restart is done: its revival's probes wait for it till then.
        self.restarts: dict[str, asyncio.Event] = {}

    def pause(self, actor: str) -> None:
        self.paused[actor] = asyncio.Event()

    def go_on(self, actor: str) -> None:
        self.paused.pop(actor).set()

    def slow_restart(self, actor: str) -> asyncio.Event:
        """From now on `actor`, once dead, answers no probe until the event returned is set."""
        return self.restarts.setdefault(actor, asyncio.Event())

    async def _call_run(self, actor: str, payload: Any) -> Any:
        self.sent.append(actor)
        if actor in self.paused:
            await self.paused[actor].wait()
        return await super()._call_run(actor, payload)

    async def _call_info(self, actor: str) -> ActorInfo:
        if actor in self.restarts and not self.dispatcher.alive(actor):
            await self.restarts[actor].wait()
        if actor in self.paused:
            self.held_probes += 1
            try:
                await self.paused[actor].wait()
            finally:
                self.held_probes -= 1
        return await super()._call_info(actor)

    async def _call_prefetch(self, actor: str, experts: list[ExpertRef]) -> dict[str, int]:
        self.sent.append(f"prefetch {actor}")
        if actor in self.paused:
            await self.paused[actor].wait()
        return await super()._call_prefetch(actor, experts)


def pausable(
    make_store: MakeStore, actors: int
) -> tuple[Store, PausablePool, IdPool, list[IdGroup]]:
    """A pausable pool of `actors` on a store of 4 experts per actor, probes timing out at
    0.05 s, and a group of two rows for each expert."""
    experts = 4 * actors
    store = Store.open(make_store(K=experts, n=3, width=6, out=2))
    inner = PausablePool(Settings(actors=actors, cache_bytes=10**6), info_timeout_s=0.05)
    groups = [IdGroup(e, torch.randn(2, 3)) for e in range(experts)]
    return store, inner, IdPool(store, inner), groups


@pytest.mark.unit
async def test_a_suspect_actor_that_answers_again_takes_groups_again(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="server.pool")
    store, inner, pool, groups = pausable(make_store, 2)
    first = await pool.run(groups)
    assert {r.actor for r in first} == {"actor-0", "actor-1"}
    inner.start_health_checks(0.01, unresponsive_s=60.0)
    inner.pause("actor-0")
    try:
        results = await asyncio.wait_for(pool.run(groups), 20)
        assert {r.actor for r in results} == {"actor-1"}
        inner.go_on("actor-0")  # its held call's late reply is not read
        await until(lambda: "actor actor-0 answers again" in caplog.text)
        again = await pool.run(groups)
        assert {r.actor for r in again} == {"actor-0", "actor-1"}
        for group, result in zip(groups, again, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert inner.hung_kills == []
        assert [a.failures for a in pool.actors()] == [{"died": 0, "hung": 0}] * 2
        # No suspect now; the suspicion stays counted, with the call given up then.
        assert [(a.suspect, a.suspicions, a.given_up_calls) for a in pool.actors()] == [
            (False, 1, 1), (False, 0, 0)
        ]
    finally:
        await pool.close()


@pytest.mark.unit
async def test_a_stopped_actor_never_killed_holds_two_probes_at_most(
    make_store: MakeStore,
) -> None:
    # Each probe sent again left the one before it waiting: with no kill (unresponsive_s 0),
    # a stopped actor, sent no calls once suspected, gathered one more pending probe every
    # timeout for as long as it stayed stopped.
    store, inner, pool, groups = pausable(make_store, 2)
    probes = record_probes(inner)
    inner.pause("actor-0")
    inner.start_health_checks(0.01, unresponsive_s=0.0)
    try:
        await until(lambda: probes.count("actor-0") >= 20)
        assert inner.held_probes <= 2
        assert inner.hung_kills == []
    finally:
        inner.go_on("actor-0")
        await pool.close()


@pytest.mark.unit
async def test_a_suspect_actor_is_sent_no_prefetch(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Each batch's prefetch for a stopped actor's experts waited as its calls do: a task more
    # for every batch until it answered or was killed.
    store, inner, pool, groups = pausable(make_store, 2)
    ids = [group.expert_id for group in groups]
    assert {inner.dispatcher.home(pool.refs[e].sha256) for e in ids} == {"actor-0", "actor-1"}
    inner.pause("actor-0")
    inner.start_health_checks(0.01, unresponsive_s=60.0)
    try:
        await until(lambda: "actor actor-0 answered no health check" in caplog.text)
        await pool.prefetch(ids)
        await until(lambda: "prefetch actor-1" in inner.sent)
        await asyncio.sleep(0.05)
        assert inner.sent == ["prefetch actor-1"]
    finally:
        inner.go_on("actor-0")
        await pool.close()


@pytest.mark.unit
async def test_an_actor_holding_a_call_is_probed_then_not_at_the_next_round(
    make_store: MakeStore,
) -> None:
    # A stop was found at the next round of probes: up to MOMLP_ACTOR_HEALTH_CHECK_S (10 s)
    # later, while its batches held the in-flight slots.
    store, inner, pool, groups = pausable(make_store, 2)
    assert {r.actor for r in await pool.run(groups)} == {"actor-0", "actor-1"}
    probes = record_probes(inner)
    inner.start_health_checks(600.0, unresponsive_s=600.0)  # one round now, the next in 600 s
    await until(lambda: sorted(probes) == ["actor-0", "actor-1"])
    inner.pause("actor-0")
    try:
        results = await asyncio.wait_for(pool.run(groups), 20)
        assert {r.actor for r in results} == {"actor-1"}
        assert probes[2:].count("actor-0") >= 1 and "actor-1" not in probes[2:]
        for group, result in zip(groups, results, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
    finally:
        inner.go_on("actor-0")
        await pool.close()


@pytest.mark.unit
async def test_a_close_ends_a_background_task_that_dropped_its_cancel() -> None:
    # On Python 3.11 `asyncio.wait_for` drops a cancel that lands as the call it waits for
    # ends: the health checks went on after the pool's close cancelled them, and the close
    # waited for them for good (a revival's loop could do the same).
    inner = FakeExpertPool(Settings(actors=1, cache_bytes=10**6))
    dropped: list[bool] = []

    async def drops_one_cancel() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if dropped:
                    raise
                dropped.append(True)

    inner._spawn(drops_one_cancel())
    await asyncio.sleep(0.05)
    await asyncio.wait_for(inner.close(), 10)
    assert dropped == [True]


@pytest.mark.unit
async def test_a_lone_suspect_actor_keeps_its_calls_until_it_answers(
    make_store: MakeStore,
) -> None:
    # With no other actor to take them, its given-up groups would only come back to it.
    store, inner, pool, groups = pausable(make_store, 1)
    await pool.run(groups)
    probes = record_probes(inner)
    inner.start_health_checks(0.01, unresponsive_s=60.0)
    inner.pause("actor-0")
    try:
        running = asyncio.ensure_future(pool.run(groups))
        await until(lambda: len(inner.sent) == 2)  # its call is held
        probed = len(probes)
        await until(lambda: len(probes) >= probed + 5)  # five probes went unanswered since
        inner.go_on("actor-0")
        for group, result in zip(groups, await asyncio.wait_for(running, 20), strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert inner.sent == ["actor-0", "actor-0"]  # answered by the call it held, not resent
    finally:
        await pool.close()


async def home_groups(pool: IdPool, groups: list[IdGroup], actor: str) -> list[IdGroup]:
    """The groups whose experts `actor` holds after a first run of them all."""
    homes = {result.expert_id: result.actor for result in await pool.run(groups)}
    return [group for group in groups if homes[group.expert_id] == actor]


@pytest.mark.unit
@pytest.mark.parametrize("first", ["suspect", "died"])
async def test_groups_every_live_actor_failed_go_to_the_first_one_answering_again(
    make_store: MakeStore, first: Literal["suspect", "died"]
) -> None:
    # actor-0 failed them (it stopped answering, or died), then their retry on actor-1 died:
    # the run waited for actor-1's revival (up to the pool's 60 s) while actor-0 answered again.
    store, inner, pool, groups = pausable(make_store, 2)
    mine = await home_groups(pool, groups, "actor-0")
    sent = len(inner.sent)
    restarted = inner.slow_restart("actor-1")
    inner.kill("actor-1")  # the retry's call dies
    if first == "suspect":
        inner.start_health_checks(0.01, unresponsive_s=60.0)
        inner.pause("actor-0")
    else:
        inner.kill("actor-0")
        inner.pause("actor-1")  # the retry's call dies once actor-0's restart answers
    try:
        running = asyncio.ensure_future(pool.run(mine))
        if first == "suspect":
            await until(lambda: not inner.dispatcher.alive("actor-1"))
            inner.go_on("actor-0")
        else:
            await until(lambda: inner.sent[sent:] == ["actor-0", "actor-1"])
            await until(lambda: inner.dispatcher.alive("actor-0"))
            inner.go_on("actor-1")
        results = await asyncio.wait_for(running, 10)
        for group, result in zip(mine, results, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert {result.actor for result in results} == {"actor-0"}
        assert inner.sent[sent:] == ["actor-0", "actor-1", "actor-0"]
        assert not inner.dispatcher.alive("actor-1")  # answered with its restart pending
    finally:
        restarted.set()
        await pool.close()


@pytest.mark.unit
async def test_an_actor_answering_its_calls_is_not_taken_for_hung_while_its_probes_are_late(
    make_store: MakeStore,
) -> None:
    async def late(actor: str) -> None:
        await asyncio.sleep(1.0)  # past the probe's timeout, every time

    store, inner, pool, probes = probed_pool(make_store, 4, 1, late)
    inner.start_health_checks(0.01, unresponsive_s=0.3)
    try:
        groups = [IdGroup(e, torch.ones(2, 3)) for e in range(4)]
        started = len(probes)
        while len(probes) < started + 12:  # ~0.6 s of late probes, twice the limit
            await pool.run(groups)
            await asyncio.sleep(0.02)
        assert inner.hung_kills == []
        assert pool.actors()[0].failures == {"died": 0, "hung": 0}
    finally:
        await pool.close()


async def two_ray_actors(
    make_store: MakeStore, channel: Literal["socket", "ray"], *, unresponsive_s: float
) -> tuple[Store, RayExpertPool, IdPool, list[IdGroup]]:
    """Two Ray actors made as the server makes them (health checks every 0.5 s), on a store
    of 12 experts, and a group of two rows for each expert."""
    store = Store.open(make_store(K=12, n=3, width=8, out=2))
    settings = Settings(
        actors=2, cache_bytes=10**7, actor_channel=channel, actor_call_timeout_s=120.0,
        actor_health_check_s=0.5, actor_unresponsive_s=unresponsive_s,
    )
    made = ray_pool()(settings)
    inner = await made if inspect.isawaitable(made) else made
    assert isinstance(inner, RayExpertPool)
    groups = [IdGroup(e, torch.randn(2, 3)) for e in range(12)]
    return store, inner, IdPool(store, inner), groups


async def stop_first_actor(inner: RayExpertPool, pool: IdPool, groups: list[IdGroup]) -> int:
    """SIGSTOP actor-0, after a run that used both actors; its pid."""
    assert {r.actor for r in await pool.run(groups)} == {"actor-0", "actor-1"}
    pid: int = await inner.handle("actor-0").get_pid.remote()
    os.kill(pid, signal.SIGSTOP)
    return pid


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("channel", ["socket", "ray"])
async def test_a_stopped_ray_actor_is_relieved_of_its_rows_then_killed_after_the_unresponsive_time(
    make_store: MakeStore, channel: Literal["socket", "ray"]
) -> None:
    # The deployment's shape: two actors fill the session's 2 CPUs. A soak found one
    # SIGSTOPped actor holding both in-flight slots until the 120 s deadline: the whole
    # server answered nothing, requests for the other actor's experts too. Then until its
    # kill (15 s with the defaults); now its rows go to the other at its first silent probe.
    store, inner, pool, groups = await two_ray_actors(make_store, channel, unresponsive_s=3.0)
    pid: int | None = None
    try:
        pid = await stop_first_actor(inner, pool, groups)
        # Bounded far below the call deadline (120 s), which the old code waited out.
        results = await asyncio.wait_for(pool.run(groups), 60)
        for group, result in zip(groups, results, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert {r.actor for r in results} == {"actor-1"}
        await until(lambda: pool.actors()[0].failures == {"died": 0, "hung": 1}, tries=1500)
        assert await pool.wait_until_alive("actor-0")
        assert await inner.handle("actor-0").get_pid.remote() != pid
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # never leave a stopped Ray worker behind
        await pool.close()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("channel", ["socket", "ray"])
async def test_a_ray_actor_stopped_for_a_while_is_passed_over_then_takes_rows_again(
    make_store: MakeStore, channel: Literal["socket", "ray"]
) -> None:
    store, inner, pool, groups = await two_ray_actors(make_store, channel, unresponsive_s=120.0)
    pid: int | None = None
    try:
        pid = await stop_first_actor(inner, pool, groups)
        results = await asyncio.wait_for(pool.run(groups), 60)
        assert {r.actor for r in results} == {"actor-1"}
        os.kill(pid, signal.SIGCONT)  # its held call's late reply is not read
        for _ in range(300):  # bounded (~30 s): until its probes are answered again
            again = await asyncio.wait_for(pool.run(groups), 60)
            if {r.actor for r in again} == {"actor-0", "actor-1"}:
                break
            await asyncio.sleep(0.1)
        for group, result in zip(groups, again, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert await inner.handle("actor-0").get_pid.remote() == pid  # never killed
        assert [a.failures for a in pool.actors()] == [{"died": 0, "hung": 0}] * 2
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await pool.close()


@pytest.mark.unit
async def test_a_stall_of_the_server_under_one_probe_does_not_get_an_answering_actor_killed(
    make_store: MakeStore,
) -> None:
    # The server's own stall while a probe was out (its process stopped or starved, its event
    # loop held) counted whole as the actor's silence: one probe timed out late, past
    # MOMLP_ACTOR_UNRESPONSIVE_S, and an actor that answered every probe was killed as hung.
    stalled: list[str] = []

    async def stalled_once(actor: str) -> None:
        if actor == "actor-1" and not stalled:
            stalled.append(actor)
            time.sleep(0.5)  # the event loop held past the limit while the probe is out
            await asyncio.sleep(0.2)  # so its answer is read only after its timeout

    store, inner, pool, probes = probed_pool(make_store, 4, 2, stalled_once)
    inner.start_health_checks(0.01, unresponsive_s=0.3)
    try:
        await until(lambda: probes.count("actor-1") >= 10)  # answered since the stall
        assert stalled == ["actor-1"]
        assert inner.hung_kills == []
        assert [a.failures for a in pool.actors()] == [{"died": 0, "hung": 0}] * 2
    finally:
        await pool.close()


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


@pytest.mark.unit
async def test_an_actor_back_from_a_death_between_probes_is_not_killed_for_old_silence() -> None:
    # actor-0's process answers no probe for 4 of its timeouts (of 5 that make it hung), then
    # dies and is back (its socket dropped, Ray restarted it) while actor-1 is probed; its new
    # process is late for its first probe only. That probe was counted on from the old
    # process's first silence: the new one was killed as hung at once.
    clock = _Clock()
    dispatcher = Dispatcher(["actor-0", "actor-1"], spill_queue_rows=64)
    deaths = {"actor-0": 0, "actor-1": 0}
    late = {"actor-0": 4}  # the old process's unanswered probes left
    killed: list[str] = []
    rounds = 0

    async def probe(actor: str) -> ActorInfo:
        nonlocal rounds
        process = f"{actor}-{deaths[actor]}"
        if actor == "actor-1":
            rounds += 1
            if rounds == 4:  # between actor-0's 4th and 5th probes: died, and back
                deaths["actor-0"] += 1
                dispatcher.mark_dead("actor-0")
                dispatcher.mark_alive("actor-0")
                late["actor-0"] = 1  # its new process, late for its first probe
        elif late[actor] > 0:
            late[actor] -= 1
            clock.t += 0.125  # its timeout passes on the clock
            await asyncio.sleep(1.0)
        return ActorInfo(name=actor, device="cpu", resident_bytes=0, budget_bytes=1,
                         process=process)

    async def no_wait(_: float) -> None:
        await asyncio.sleep(0.001)

    checks = asyncio.ensure_future(check_health(
        dispatcher, probe=probe, deaths=deaths.__getitem__, died=killed.append,
        hung=killed.append, suspect=lambda _: None, answered=lambda _: None,
        replied=lambda _: float("-inf"), clock=clock, sleep=no_wait,
        period_s=1.0, timeout_s=0.125, unresponsive_s=0.625,
    ))
    try:
        await until(lambda: rounds >= 10 or checks.done())
        assert not checks.done()
        assert killed == []
    finally:
        # Python 3.11's wait_for drops a cancel that lands as its probe answers: sent again.
        while not checks.done():
            checks.cancel()
            await asyncio.sleep(0.01)


@pytest.mark.unit
async def test_an_actor_whose_probes_are_late_is_not_killed_once_suspected_and_sent_no_calls(
    make_store: MakeStore,
) -> None:
    # Suspected at a probe late with no call answered while it waited, it was sent no more
    # calls, so none could be answered: its late probes alone got it killed as hung (a
    # restart, its cache lost), where an actor sent calls that it answers never was.
    async def late(actor: str) -> None:
        if actor == "actor-1":
            await asyncio.sleep(0.15)  # past the probe's timeout, within unresponsive_s

    store, inner, pool, probes = probed_pool(make_store, 8, 2, late)
    groups = [IdGroup(e, torch.ones(2, 3)) for e in range(8)]
    assert {r.actor for r in await pool.run(groups)} == {"actor-0", "actor-1"}
    inner.start_health_checks(0.01, unresponsive_s=0.5)
    try:
        started = probes.count("actor-1")
        while probes.count("actor-1") < started + 12:
            # Gaps between the batches longer than a probe's timeout: it goes unanswered
            # with no call answered meanwhile, and the actor is a suspect.
            for group, result in zip(groups, await pool.run(groups), strict=True):
                torch.testing.assert_close(result.outputs, expected(store, group))
            await asyncio.sleep(0.1)
        assert inner.hung_kills == []
        assert [a.failures for a in pool.actors()] == [{"died": 0, "hung": 0}] * 2
    finally:
        await pool.close()


@pytest.mark.unit
async def test_metrics_and_the_experts_listing_show_a_suspect_and_its_calls_given_up(
    make_store: MakeStore,
) -> None:
    # A suspicion was only a WARNING line: an operator could not see that an actor alive
    # (`momlp_actor_alive` 1) took no rows, nor count the rows computed twice.
    store = make_store(K=8, n=4, width=16, out=2)

    def pool_factory(settings: Settings) -> FakeExpertPool:
        pool = FakeExpertPool(settings, info_timeout_s=0.05)
        pool.start_health_checks(0.01, unresponsive_s=60.0)
        return pool

    app = create_app(app_settings(store, actor_call_timeout_s=120.0), pool_factory=pool_factory)
    rows = np.random.default_rng(3).uniform(-1, 1, (64, 4)).tolist()
    async with running(app) as client:
        pool = app.state.serving.pool
        assert (await client.post("/v1/predict", json={"inputs": rows})).status_code == 200
        before = (await client.get("/metrics")).text
        pool.hang("actor-0", frozen=True)
        # Bounded far below the call deadline (120 s), which a batch on it would wait out.
        answered = await asyncio.wait_for(client.post("/v1/predict", json={"inputs": rows}), 20)
        assert answered.status_code == 200
        metrics = (await client.get("/metrics")).text
        actors = (await client.get("/v1/experts")).json()["actors"]
    for actor in ("actor-0", "actor-1"):
        assert f'momlp_actor_suspect{{actor="{actor}"}} 0.0' in before
        assert f'momlp_actor_suspicions_total{{actor="{actor}"}} 0.0' in before
    assert 'momlp_actor_suspect{actor="actor-0"} 1.0' in metrics
    assert 'momlp_actor_suspect{actor="actor-1"} 0.0' in metrics
    assert 'momlp_actor_suspicions_total{actor="actor-0"} 1.0' in metrics
    assert 'momlp_actor_calls_given_up_total{actor="actor-0"} 1.0' in metrics
    assert 'momlp_actor_calls_given_up_total{actor="actor-1"} 0.0' in metrics
    assert 'momlp_actor_alive{actor="actor-0"} 1.0' in metrics  # alive, not killed
    assert [(a["name"], a["alive"], a["suspect"]) for a in actors] == [
        ("actor-0", True, True), ("actor-1", True, False)
    ]
