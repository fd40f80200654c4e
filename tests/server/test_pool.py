"""RayExpertPool against real Ray actors (few, small, fast)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from pool_support import IdGroup, IdPool, expected

from experts_store import ExpertTooLarge, Store
from router import PrototypeTree
from server import ActorFailed, ExpertUnavailable, PoolStartFailed
from server._settings import Settings
from server.batching import Batcher
from server.kinds import MomlpModel
from server.pool import RayExpertPool

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

MakeStore = Callable[..., Path]


def random_groups(rng: np.random.Generator, K: int, n: int, count: int) -> list[IdGroup]:
    experts = rng.choice(K, size=count, replace=False)
    return [
        IdGroup(int(e), torch.from_numpy(rng.standard_normal((int(rng.integers(1, 9)), n))).float())
        for e in experts
    ]


async def start(store: Store, **settings: int | str) -> IdPool:
    pool = await asyncio.to_thread(
        RayExpertPool.create,
        Settings(**settings),  # type: ignore[arg-type]
    )
    return IdPool(store, pool)


@pytest.mark.parametrize("channel", ["socket", "ray"])
async def test_outputs_match_the_files_and_caches_stay_in_budget(
    make_store: MakeStore, channel: str
) -> None:
    store = Store.open(make_store(K=50, n=4, width=16, out=3))
    budget = 5 * store.expert_nbytes(0)
    pool = await start(store, actors=2, cache_bytes=budget, actor_channel=channel)
    rng = np.random.default_rng(0)
    misses = 0
    try:
        for _ in range(12):
            groups = random_groups(rng, 50, 4, int(rng.integers(1, 12)))
            results = await pool.run(groups)
            assert [r.expert_id for r in results] == [g.expert_id for g in groups]
            for group, result in zip(groups, results, strict=True):
                assert result.error is None
                torch.testing.assert_close(result.outputs, expected(store, group))
                assert 0 < result.device_bytes <= budget
            misses += sum(not result.hit for result in results)
            for info in pool.actors():
                assert info.resident_bytes <= budget and len(info.resident) <= 5
        assert {info.name for info in pool.actors()} == {"actor-0", "actor-1"}
        # The actors' own counters reach the pool over either channel: a group per expert
        # and call, so every miss is one load here.
        counts = [info.counts for info in pool.actors()]
        assert sum(c.loads for c in counts) == misses > 0
        assert sum(c.load_bytes for c in counts) == misses * store.expert_nbytes(0)
        assert sum(c.evictions for c in counts) == misses - sum(
            len(info.resident) for info in pool.actors()
        )
        assert {pool.transport(name) for name in ("actor-0", "actor-1")} == {channel}
    finally:
        await pool.close()


async def test_without_a_folder_for_sockets_the_pool_serves_over_ray_calls(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store.open(make_store(K=8, n=3, width=8, out=2))
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/momlp-tmp")  # mkdtemp fails
    pool = await start(store, actors=2, cache_bytes=10**7)
    try:
        groups = random_groups(np.random.default_rng(5), 8, 3, 6)
        for group, result in zip(groups, await pool.run(groups), strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert {pool.transport(name) for name in ("actor-0", "actor-1")} == {"ray"}
    finally:
        await pool.close()


async def test_two_actors_never_load_an_expert_twice_while_it_fits(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=10, n=3, width=8, out=2))
    pool = await start(store, actors=2, cache_bytes=10 * store.expert_nbytes(0))
    rng = np.random.default_rng(1)
    misses: Counter[int] = Counter()
    try:
        for _ in range(6):
            results = await pool.run(random_groups(rng, 10, 3, 6))
            misses.update(r.expert_id for r in results if not r.hit)
        assert set(misses.values()) == {1}
        # The two caches partition the experts: each is held by exactly one actor.
        assert all(len(actors) == 1 for actors in pool.residency().values())
    finally:
        await pool.close()


@pytest.mark.parametrize("policy", ["tinylfu", "lru"])
async def test_the_cache_policy_decides_whether_hot_experts_outlast_one_off_requests(
    make_store: MakeStore, policy: str
) -> None:
    store = Store.open(make_store(K=24, n=3, width=8, out=2))
    pool = await start(store, actors=1, cache_bytes=4 * store.expert_nbytes(0), cache_policy=policy)
    rows = torch.ones(1, 3)
    try:
        for _ in range(4):
            await pool.run([IdGroup(e, rows) for e in (0, 1, 2)])
        for one_off in range(3, 24):
            await pool.run([IdGroup(one_off, rows)])
        hot = await pool.run([IdGroup(e, rows) for e in (0, 1, 2)])
        hits = [r.hit for r in hot]
        assert hits == ([True] * 3 if policy == "tinylfu" else [False] * 3)
    finally:
        await pool.close()


async def test_after_a_swap_the_new_experts_displace_the_old_popular_ones(
    make_store: MakeStore,
) -> None:
    # What the server does when a new store version goes live; without it, the old
    # version's popular experts (never asked for again) win every admission contest.
    store = Store.open(make_store(K=24, n=3, width=8, out=2))
    pool = await start(store, actors=1, cache_bytes=4 * store.expert_nbytes(0))
    rows = torch.ones(1, 3)
    try:
        for _ in range(20):
            await pool.run([IdGroup(e, rows) for e in (0, 1, 2)])
        await pool.forget_popularity()
        hits = [(await pool.run([IdGroup(e, rows)]))[0].hit for e in [10, 11] * 5]
        assert hits[2:] == [True] * 8
        # The actor's channel started its tables of refs over at the swap: an expert sent
        # before it is defined again, and its rows still come back right.
        assert pool.transport("actor-0") == "socket"
        again = [IdGroup(0, rows), IdGroup(10, rows)]
        for group, result in zip(again, await pool.run(again), strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
    finally:
        await pool.close()


@pytest.mark.parametrize("channel", ["socket", "ray"])
async def test_killing_an_actor_mid_stream_loses_and_duplicates_nothing(
    make_store: MakeStore, channel: str
) -> None:
    store = Store.open(make_store(K=16, n=4, width=32, out=2))
    pool = await start(store, actors=2, cache_bytes=10**7, actor_channel=channel)
    rng = np.random.default_rng(2)
    batches = [random_groups(rng, 16, 4, 8) for _ in range(30)]
    try:
        pid = await pool.handle("actor-0").get_pid.remote()
        tasks = [asyncio.create_task(pool.run(groups)) for groups in batches]
        await asyncio.sleep(0)  # let the first calls reach the actors
        os.kill(pid, signal.SIGKILL)
        answers = await asyncio.gather(*tasks)
        for groups, results in zip(batches, answers, strict=True):
            assert [r.expert_id for r in results] == [g.expert_id for g in groups]
            for group, result in zip(groups, results, strict=True):
                torch.testing.assert_close(result.outputs, expected(store, group))
        # Ray restarts the actor; it serves again, with a new process and an empty cache.
        assert await pool.wait_until_alive("actor-0")
        new_pid = await pool.handle("actor-0").get_pid.remote()
        assert new_pid != pid
        results = await pool.run(batches[0])
        assert all(r.error is None for r in results)
        assert pool.transport("actor-0") == channel  # the new process got a channel too
    finally:
        await pool.close()


@pytest.mark.parametrize("channel", ["socket", "ray"])
async def test_an_actor_out_of_restarts_is_replaced_by_a_new_one(
    make_store: MakeStore, channel: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Ray's restarts count over an actor's whole life: once spent, the actor stayed dead for
    # good, and a server running for weeks lost its actors one by one. Two actors fill the
    # session's Ray (one CPU each), so the new one gets the dead one's CPU or none.
    store = Store.open(make_store(K=8, n=2, width=8, out=1))
    pool = await start(
        store, actors=2, cache_bytes=10**7, actor_max_restarts=0, actor_channel=channel
    )
    groups = [IdGroup(e, torch.randn(3, 2, generator=torch.Generator().manual_seed(e)))
              for e in range(8)]
    try:
        await pool.run(groups)
        old = pool.handle("actor-0")
        pid = await old.get_pid.remote()
        os.kill(pid, signal.SIGKILL)
        results = await pool.run(groups)  # actor-1 takes the rows meanwhile
        for group, result in zip(groups, results, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert await pool.wait_until_alive("actor-0")
        assert pool.handle("actor-0") is not old
        assert await pool.handle("actor-0").get_pid.remote() != pid
        after = await pool.run(groups)
        assert "actor-0" in {r.actor for r in after}  # it serves its experts again
        for group, result in zip(groups, after, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert pool.transport("actor-0") == channel
        assert "actor actor-0 is out of restarts (MOMLP_ACTOR_MAX_RESTARTS): starting a new " \
            "actor in its place" in caplog.text
    finally:
        await pool.close()


async def test_a_replacement_dying_within_the_interval_fails_requests_at_once(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # An actor that dies as it starts must not be started again and again; and requests
    # that need it must not wait out the revival's timeout (60 s) for a start that waits for
    # the interval: Ray answers such an actor's calls with ActorDiedError.
    store = Store.open(make_store(K=4, n=2, width=8, out=1))
    pool = await start(store, actors=1, actor_max_restarts=0, actor_channel="ray")
    rng = np.random.default_rng(3)
    groups = random_groups(rng, 4, 2, 2)
    try:
        assert all(r.error is None for r in await pool.run(groups))
        os.kill(await pool.handle("actor-0").get_pid.remote(), signal.SIGKILL)
        assert all(r.error is None for r in await pool.run(groups))  # on its replacement
        os.kill(await pool.handle("actor-0").get_pid.remote(), signal.SIGKILL)
        with pytest.raises(ActorFailed):
            await pool.run(groups)
        assert not await pool.wait_until_alive("actor-0")
        assert [actor.alive for actor in pool.actors()] == [False]
        assert "actor actor-0 is out of restarts again" in caplog.text
        assert "the next starts in" in caplog.text
        assert "did not come back within" not in caplog.text
    finally:
        await pool.close()


async def test_a_replacement_that_cannot_be_placed_says_what_the_cluster_has_free(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # The log said only "not up within 10 s": nothing told the operator (whom the
    # MomlpActorDead alert sends to the log) that the cluster had no room for it, or which.
    import ray

    @ray.remote(num_cpus=1)
    class Blocker:
        def ping(self) -> int:
            return os.getpid()

    store = Store.open(make_store(K=8, n=2, width=8, out=1))
    pool = await start(
        store, actors=2, cache_bytes=10**7, actor_max_restarts=0, actor_channel="ray",
        actor_start_timeout_s=10,  # a start on a loaded machine takes seconds
    )
    blocker = Blocker.remote()  # type: ignore[attr-defined]
    try:
        homed = [e for e in range(8) if pool.dispatcher.home(e) == "actor-0"]
        assert homed
        groups = [IdGroup(e, torch.randn(2, 2, generator=torch.Generator().manual_seed(e)))
                  for e in homed]
        # The session's two CPUs are the actors'; the blocker waits for one and takes the one
        # actor-0's death gives back, before a new actor in its place can.
        os.kill(await pool.handle("actor-0").get_pid.remote(), signal.SIGKILL)
        await blocker.ping.remote()
        results = await pool.run(groups)  # actor-1 takes the rows
        for group, result in zip(groups, results, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        assert not await pool.wait_until_alive("actor-0")
        assert "actor actor-0: the new actor in its place did not start: not placed and up " \
            "within 10 s (MOMLP_ACTOR_START_TIMEOUT_S); the cluster has {" in caplog.text
        assert "'CPU': 2.0" in caplog.text and "free" in caplog.text
        assert "actor actor-0: no new actor in its place yet; the next try in 60 s" in caplog.text
    finally:
        ray.kill(blocker)
        await pool.close()


@pytest.mark.parametrize("restarts", [0, 1])
async def test_an_idle_pool_learns_of_a_dead_actor_from_its_socket(
    make_store: MakeStore, restarts: int
) -> None:
    # Dead was known only at the next call to it: with no traffic, /readyz said ready for as
    # long as the actors were gone (~50 s when a Ray cluster stopped under the server).
    store = Store.open(make_store(K=8, n=2, width=8, out=1))
    pool = await start(
        store, actors=2, cache_bytes=10**7, actor_channel="socket", actor_max_restarts=restarts
    )
    groups = [IdGroup(e, torch.ones(2, 2)) for e in range(8)]
    try:
        await pool.run(groups)  # every actor gets work, so each opens its channel
        assert [pool.transport(a) for a in ("actor-0", "actor-1")] == ["socket", "socket"]
        pid = await pool.handle("actor-0").get_pid.remote()
        os.kill(pid, signal.SIGKILL)
        alive = {"actor-0": True}
        for _ in range(100):
            alive = {a.name: a.alive for a in pool.actors()}
            if not alive["actor-0"]:
                break
            await asyncio.sleep(0.05)
        assert alive == {"actor-0": False, "actor-1": True}
        # Restarted by Ray, or, out of restarts, replaced by the pool.
        assert await pool.wait_until_alive("actor-0")
        results = await pool.run(groups)
        assert all(r.error is None for r in results)
        assert {r.actor for r in results} == {"actor-0", "actor-1"}
    finally:
        await pool.close()


async def test_a_restarted_actor_serves_its_experts_again(make_store: MakeStore) -> None:
    # The survivor had loaded them all meanwhile, and kept them: the restarted actor got no
    # rows, and the pool ran on one actor for good.
    store = Store.open(make_store(K=12, n=2, width=8, out=1))
    pool = await start(store, actors=2, cache_bytes=10**7, actor_channel="socket")
    groups = [IdGroup(e, torch.ones(2, 2)) for e in range(12)]
    try:
        before = {r.expert_id: r.actor for r in await pool.run(groups)}
        assert set(before.values()) == {"actor-0", "actor-1"}
        pid = await pool.handle("actor-0").get_pid.remote()
        os.kill(pid, signal.SIGKILL)
        during = await pool.run(groups)
        assert {r.actor for r in during} == {"actor-1"} and all(r.error is None for r in during)
        assert await pool.wait_until_alive("actor-0")
        after = {r.expert_id: r.actor for r in await pool.run(groups)}
        assert after == before
        assert pool.transport("actor-0") == "socket"
    finally:
        await pool.close()


async def test_a_host_cache_on_cpu_actors_is_reported_where_the_server_logs(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Only the actors said so, in logs that stay on the Ray nodes.
    store = Store.open(make_store(K=4, n=2, width=8, out=1))
    with caplog.at_level("WARNING", logger="server.pool._ray"):
        pool = await start(store, actors=1, host_cache_bytes=2**20, device="cpu")
    try:
        assert "host_cache_bytes (1048576) applies to CUDA actors only; ignored on cpu actors" in (
            caplog.text
        )
    finally:
        await pool.close()


async def test_a_corrupted_expert_fails_only_the_requests_that_need_it(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=8, n=2, width=8, out=1))
    router = PrototypeTree.load(store.router_path)
    path = store.expert_path(5)
    path.write_bytes(path.read_bytes()[:-4] + b"\x00\x01\x02\x03")
    settings = Settings(actors=2, cache_bytes=10**7, max_batch_wait_ms=5.0)
    pool = await asyncio.to_thread(RayExpertPool.create, settings)
    refs = [store.expert_ref(e.id) for e in store.manifest.experts]
    batcher = Batcher(MomlpModel(router, refs, store.manifest), pool, settings)
    try:
        xs = [torch.randn(3, 2, generator=torch.Generator().manual_seed(s)) for s in range(40)]
        answers = await asyncio.gather(*(batcher.submit(x) for x in xs), return_exceptions=True)
        needs_5 = [bool((router.route(x).experts == 5).any()) for x in xs]
        assert any(needs_5) and not all(needs_5)
        for x, needs, answer in zip(xs, needs_5, answers, strict=True):
            if needs:
                assert isinstance(answer, ExpertUnavailable) and answer.expert_id == 5
            else:
                assert not isinstance(answer, BaseException)
                routed = router.route(x).experts[:, 0]
                want = torch.cat(
                    [expected(store, IdGroup(int(e), x[i : i + 1])) for i, e in enumerate(routed)]
                )
                torch.testing.assert_close(torch.from_numpy(answer.outputs), want)
    finally:
        await batcher.close()
        await pool.close()


async def test_an_expert_larger_than_the_budget_refuses_to_start(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=3, n=2, width=8, out=1))
    settings = Settings(cache_bytes=store.expert_nbytes(0) // 2)
    pool = await asyncio.to_thread(RayExpertPool.create, settings)
    try:
        with pytest.raises(ExpertTooLarge):
            IdPool(store, pool)
    finally:
        await pool.close()


async def test_actors_the_cluster_cannot_place_fail_the_start_naming_what_they_asked() -> None:
    # No node offers this resource: the actor stays pending until the start timeout.
    settings = Settings(actor_resource="momlp-no-such-node", actor_start_timeout_s=2.0)
    with pytest.raises(PoolStartFailed) as info:
        await asyncio.to_thread(RayExpertPool.create, settings)
    message = str(info.value)
    assert "momlp-no-such-node" in message and "within 2 s" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's Ray counts a GPU")
async def test_cuda_asked_of_an_embedded_ray_without_gpus_fails_at_once() -> None:
    # It waited out the 60 s start timeout: an embedded Ray never gains a GPU.
    settings = Settings(device="cuda", actor_start_timeout_s=60.0)
    with pytest.raises(PoolStartFailed) as info:
        await asyncio.to_thread(RayExpertPool.create, settings)
    assert "counts none" in str(info.value) and "--device cpu" in str(info.value)


async def test_an_actor_that_fails_to_start_fails_the_start_with_its_reason() -> None:
    # torch refuses 0 threads inside the actor's __init__: the start fails at once (not after
    # the 60 s start timeout), naming the actor's own error in one line.
    settings = Settings(actor_start_timeout_s=60.0)
    with pytest.raises(PoolStartFailed) as info:
        await asyncio.to_thread(RayExpertPool.create, settings, torch_threads=0)
    message = str(info.value)
    assert "a cpu actor failed to start" in message
    assert message.rstrip().endswith("set_num_threads expects a positive integer")
    assert "\n" not in message
