from __future__ import annotations

from collections import Counter

import pytest

from server._settings import Settings
from server.pool import Dispatcher, FakeExpertPool, rendezvous_rank
from server.pool._dispatch import _score

pytestmark = pytest.mark.unit

ACTORS = ["actor-0", "actor-1", "actor-2"]


def test_home_is_stable_and_spreads_experts_over_actors() -> None:
    dispatcher = Dispatcher(ACTORS, spill_queue_rows=100)
    homes = [dispatcher.home(e) for e in range(3000)]
    assert homes == [dispatcher.home(e) for e in range(3000)]
    counts = Counter(homes)
    assert set(counts) == set(ACTORS)
    # Highest-random-weight hashing: each actor gets about a third of the experts.
    assert all(800 < c < 1200 for c in counts.values())


async def test_a_new_version_drops_the_cached_scores_and_ranks_alike() -> None:
    # Each swap's changed experts are new keys: kept, they filled the cache to its cap.
    keys = [f"{e:064x}" for e in range(50)]
    before = [rendezvous_rank(key, ACTORS) for key in keys]
    assert _score.cache_info().currsize >= len(keys) * len(ACTORS)
    pool = FakeExpertPool(Settings(actors=3, cache_bytes=10**6))
    try:
        await pool.forget_popularity()  # what the server calls when a new version goes live
        assert _score.cache_info().currsize == 0
    finally:
        await pool.close()
    assert [rendezvous_rank(key, ACTORS) for key in keys] == before


def test_removing_an_actor_moves_only_its_experts() -> None:
    before = {e: rendezvous_rank(e, ACTORS)[0] for e in range(1000)}
    after = {e: rendezvous_rank(e, ["actor-0", "actor-2"])[0] for e in range(1000)}
    moved = {e for e in before if before[e] != after[e]}
    assert moved == {e for e in before if before[e] == "actor-1"}


def test_unheld_expert_goes_home_and_counts_as_queued() -> None:
    dispatcher = Dispatcher(ACTORS, spill_queue_rows=100)
    [actor] = dispatcher.place([(7, 5)])
    assert actor == dispatcher.home(7)
    assert dispatcher.queued_rows(actor) == 5
    dispatcher.complete(actor, 5)
    assert dispatcher.queued_rows(actor) == 0


def test_held_expert_goes_to_the_least_queued_holder() -> None:
    dispatcher = Dispatcher(ACTORS, spill_queue_rows=100)
    home = dispatcher.home(3)
    busy, idle = [a for a in ACTORS if a != home]
    dispatcher.update_residency(busy, {3: 10, 50: 10})
    dispatcher.update_residency(idle, {3: 10})
    assert dispatcher.place([(50, 20)]) == [busy]  # 50 is held by `busy` only
    assert dispatcher.place([(3, 1)]) == [idle]  # held by both: the less queued one
    assert dispatcher.queued_rows(idle) == 1
    dispatcher.complete(busy, 20)
    dispatcher.place([(50, 5)])
    dispatcher.complete(busy, 5)
    # Equal queues: the holder ranked first for the expert wins, never the non-holder home.
    assert dispatcher.place([(3, 1)])[0] in (busy, idle)


def test_hot_expert_spills_to_its_second_choice_when_home_is_saturated() -> None:
    dispatcher = Dispatcher(ACTORS, spill_queue_rows=10)
    first, second, _ = rendezvous_rank(5, ACTORS)
    assert dispatcher.place([(5, 11)]) == [first]
    # The home now has 11 > 10 rows queued: the next rows of 5 spill to its second choice.
    assert dispatcher.place([(5, 3)]) == [second]
    dispatcher.complete(first, 11)
    assert dispatcher.place([(5, 1)]) == [first]


def test_dead_actor_gets_nothing_and_loses_its_residency() -> None:
    dispatcher = Dispatcher(ACTORS, spill_queue_rows=100)
    victim = dispatcher.home(1)
    assert victim is not None
    dispatcher.update_residency(victim, {1: 8, 2: 8})
    assert dispatcher.residency()[1] == [victim]
    dispatcher.mark_dead(victim)
    assert 1 not in dispatcher.residency()
    placed = dispatcher.place([(e, 1) for e in range(200)])
    assert victim not in placed
    dispatcher.mark_alive(victim)
    assert victim in dispatcher.place([(e, 1) for e in range(200)])


def test_place_returns_none_without_live_actors() -> None:
    dispatcher = Dispatcher(["a"], spill_queue_rows=1)
    assert dispatcher.place([(0, 1)], exclude=["a"]) == [None]
    dispatcher.mark_dead("a")
    assert dispatcher.place([(0, 1)]) == [None]


def test_residency_lists_every_holder() -> None:
    dispatcher = Dispatcher(ACTORS, spill_queue_rows=100)
    dispatcher.update_residency("actor-0", {1: 4, 2: 4})
    dispatcher.update_residency("actor-2", {2: 4})
    assert dispatcher.residency() == {1: ["actor-0"], 2: ["actor-0", "actor-2"]}
    dispatcher.update_residency("actor-0", {})
    assert dispatcher.residency() == {2: ["actor-2"]}


def test_a_revived_actor_takes_its_experts_back_from_the_actor_that_held_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The survivor held every expert after the death, and "holders first" kept them all there:
    # the revived actor got no rows again, the pool ran at half its capacity.
    dispatcher = Dispatcher(["actor-0", "actor-1"], spill_queue_rows=10_000)
    experts = list(range(200))
    homed = [e for e in experts if dispatcher.home(e) == "actor-0"]
    with caplog.at_level("WARNING", logger="server.pool._dispatch"):
        dispatcher.mark_dead("actor-0")
        dispatcher.mark_dead("actor-0")  # each failing call says so; logged once
    assert caplog.text.count("actor actor-0 marked dead") == 1
    assert dispatcher.place([(e, 1) for e in experts]) == ["actor-1"] * 200
    dispatcher.complete("actor-1", 200)
    dispatcher.update_residency("actor-1", dict.fromkeys(experts, 1))
    dispatcher.mark_alive("actor-0")
    placed = dict(zip(experts, dispatcher.place([(e, 1) for e in experts]), strict=True))
    assert {e for e, actor in placed.items() if actor == "actor-0"} == set(homed)
    # Held by both once it has loaded them: the least queued (then the home) takes them.
    dispatcher.update_residency("actor-0", dict.fromkeys(homed, 1))
    for actor in ("actor-0", "actor-1"):
        dispatcher.complete(actor, 1000)
    assert dispatcher.place([(homed[0], 1)]) == ["actor-0"]


def test_load_target_is_where_the_rows_go_when_that_actor_lacks_the_expert() -> None:
    dispatcher = Dispatcher(["actor-0", "actor-1"], spill_queue_rows=10_000)
    experts = list(range(40))
    homes = {e: dispatcher.home(e) for e in experts}
    assert {e: dispatcher.load_target(e) for e in experts} == homes  # nothing held yet
    dispatcher.update_residency("actor-1", dict.fromkeys(experts, 1))
    assert all(dispatcher.load_target(e) is None for e in experts)  # rows go to the holder
    dispatcher.mark_dead("actor-0")
    dispatcher.mark_alive("actor-0")
    # Restarted: its experts' rows go home again, where they are not held yet.
    assert {e: dispatcher.load_target(e) for e in experts} == {
        e: "actor-0" if home == "actor-0" else None for e, home in homes.items()
    }
    dispatcher.mark_dead("actor-0")
    dispatcher.mark_dead("actor-1")
    assert all(dispatcher.load_target(e) is None for e in experts)  # no actor alive
