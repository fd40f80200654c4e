"""The tinylfu policy of ExpertCache: who stays cached, and that every guarantee still holds."""

from __future__ import annotations

import itertools
import random
from contextlib import ExitStack

import pytest
from cache_helpers import FakeLoader

from experts_store import CacheBusy, ExpertCache
from experts_store._climber import WindowClimber
from experts_store._frequency import FrequencyCounter

pytestmark = pytest.mark.unit


def _lease_all(cache: ExpertCache[str], expert_ids: list[int]) -> list[bool]:
    hits = []
    for expert_id in expert_ids:
        with cache.lease(expert_id) as lease:
            hits.append(lease.hit)
    return hits


def _zipf_trace(num_experts: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / rank for rank in range(1, num_experts + 1)]
    return rng.choices(range(num_experts), weights=weights, k=length)


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
def test_popular_experts_survive_a_run_of_one_off_requests_only_under_tinylfu(
    policy: str,
) -> None:
    loader = FakeLoader({i: 10 for i in range(100)})
    cache: ExpertCache[str] = ExpertCache(40, loader, policy=policy)  # type: ignore[arg-type]
    _lease_all(cache, [0, 1, 2] * 5)
    _lease_all(cache, list(range(10, 40)))  # each asked for once
    hot_hits = _lease_all(cache, [0, 1, 2])
    if policy == "tinylfu":
        assert hot_hits == [True] * 3
        assert {0, 1, 2} <= set(cache.resident())
        assert cache.stats.rejections >= 29
    else:
        assert hot_hits == [False] * 3
        assert cache.stats.rejections == 0


def test_a_newcomer_is_always_served_even_when_it_is_not_admitted() -> None:
    loader = FakeLoader({i: 10 for i in range(10)})
    cache: ExpertCache[str] = ExpertCache(30, loader, policy="tinylfu")
    _lease_all(cache, [0, 1, 2] * 3)
    for newcomer in (5, 6, 7):
        with cache.lease(newcomer) as lease:
            assert lease.value == f"expert-{newcomer}" and not lease.hit
            assert newcomer in cache.resident()
    assert loader.loads == {0: 1, 1: 1, 2: 1, 5: 1, 6: 1, 7: 1}
    # Two of the three popular experts were admitted; the window holds the last newcomer.
    assert len({0, 1, 2} & set(cache.resident())) == 2
    assert 7 in cache.resident()


def test_tinylfu_nears_the_best_online_hit_rate_on_zipf_traffic_where_lru_falls_short() -> None:
    num_experts, capacity, length = 1000, 100, 40_000
    trace = _zipf_trace(num_experts, length, seed=3)
    rates = {}
    for policy in ("lru", "tinylfu"):
        cache: ExpertCache[str] = ExpertCache(
            capacity,
            FakeLoader(dict.fromkeys(range(num_experts), 1)),
            policy=policy,  # type: ignore[arg-type]
        )
        rates[policy] = sum(_lease_all(cache, trace)) / length
    # Under independent requests no online policy beats keeping the most popular experts.
    weights = [1.0 / rank for rank in range(1, num_experts + 1)]
    static_bound = sum(weights[:capacity]) / sum(weights)
    assert rates["tinylfu"] >= 0.95 * static_bound
    assert rates["tinylfu"] >= rates["lru"] + 0.05


def test_newly_popular_experts_take_over_once_the_old_ones_cool_down() -> None:
    loader = FakeLoader({i: 10 for i in range(300)})
    cache: ExpertCache[str] = ExpertCache(60, loader, policy="tinylfu")
    one_offs = itertools.count(200)
    old, new = [0, 1, 2, 3, 4], [100, 101, 102, 103, 104]
    for round_ in range(400):
        _lease_all(cache, [*old, next(one_offs) % 300 if round_ % 2 else old[0]])
    assert set(old) <= set(cache.resident())
    for round_ in range(800):
        _lease_all(cache, [*new, 200 + round_ % 100])
    assert set(new) <= set(cache.resident())
    assert _lease_all(cache, new) == [True] * 5


def test_budget_leases_and_hit_reports_hold_under_tinylfu_with_mixed_sizes() -> None:
    rng = random.Random(99)
    sizes = {i: rng.choice([1, 3, 7, 20, 45]) for i in range(60)}
    budget = 100
    loader = FakeLoader(sizes)
    cache: ExpertCache[str] = ExpertCache(budget, loader, policy="tinylfu")
    held: dict[int, ExitStack] = {}
    popularity = [1.0 / (1 + i) for i in range(60)]
    for _ in range(10_000):
        expert_id = rng.choices(range(60), weights=popularity)[0]
        if held and rng.random() < 0.3:
            held.pop(rng.choice(list(held))).close()
        was_resident = expert_id in cache.resident()
        stack = ExitStack()
        try:
            lease = stack.enter_context(cache.lease(expert_id, timeout=0))
        except CacheBusy:
            # Only when leased experts leave no room.
            pinned = sum(sizes[i] for i in held)
            assert budget - pinned < sizes[expert_id]
            continue
        assert lease.hit == was_resident
        assert lease.value == f"expert-{expert_id}"
        if rng.random() < 0.2 and expert_id not in held:
            held[expert_id] = stack
        else:
            stack.close()
        resident = cache.resident()
        assert cache.used_bytes <= budget
        assert sum(resident.values()) == cache.resident_bytes
        assert set(held) <= set(resident)
    stats = cache.stats
    assert stats.loads == stats.misses == sum(loader.loads.values())
    assert stats.evictions == stats.loads - len(cache.resident())
    assert 0 < stats.rejections <= stats.evictions


def test_prefetch_under_tinylfu_loads_the_expert_and_spares_the_kept_ones() -> None:
    loader = FakeLoader({i: 10 for i in range(10)})
    cache: ExpertCache[str] = ExpertCache(30, loader, policy="tinylfu")
    _lease_all(cache, [0, 1, 2])
    assert not cache.prefetch(3, keep={0, 1, 2})
    assert cache.prefetch(3, keep={0, 1})
    assert set(cache.resident()) == {0, 1, 3}
    assert _lease_all(cache, [3]) == [True]


def test_policy_and_window_are_checked() -> None:
    loader = FakeLoader({0: 1})
    with pytest.raises(ValueError, match="policy must be one of lru, tinylfu"):
        ExpertCache(10, loader, policy="lfu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_fraction"):
        ExpertCache(10, loader, policy="tinylfu", window_fraction=1.5)


def test_frequency_counts_halve_after_each_sample() -> None:
    counter = FrequencyCounter(per_entry=10, minimum=20)
    assert counter.sample_size(1) == 20 and counter.sample_size(5) == 50
    for _ in range(7):
        counter.record(1, entries=1)
    for _ in range(12):
        counter.record(2, entries=1)
    assert (counter.estimate(1), counter.estimate(2), counter.halvings) == (7, 12, 0)
    counter.record(3, entries=1)  # the 20th access: every count halves, ones vanish
    assert (counter.estimate(1), counter.estimate(2), counter.estimate(3)) == (3, 6, 0)
    assert counter.halvings == 1
    with pytest.raises(ValueError):
        FrequencyCounter(per_entry=0)


def _bursty_trace(num_experts: int, length: int, seed: int) -> list[int]:
    """Sessions: an expert is asked for a few times in a short while, then not again."""
    rng = random.Random(seed)
    weights = [1.0 / rank for rank in range(1, num_experts + 1)]
    active: list[list[int]] = []
    trace: list[int] = []
    while len(trace) < length:
        while len(active) < 50:
            expert_id = rng.choices(range(num_experts), weights=weights)[0]
            active.append([expert_id, 1 + int(rng.expovariate(1 / 8))])
        session = rng.randrange(len(active))
        trace.append(active[session][0])
        active[session][1] -= 1
        if active[session][1] <= 0:
            active.pop(session)
    return trace


def test_tinylfu_keeps_up_with_lru_on_bursty_traffic() -> None:
    # A fixed one-expert window would lose about 20 points here; the climber widens it.
    trace = _bursty_trace(1000, 40_000, seed=5)
    rates = {}
    for policy in ("lru", "tinylfu"):
        cache: ExpertCache[str] = ExpertCache(
            100, FakeLoader(dict.fromkeys(range(1000), 1)), policy=policy  # type: ignore[arg-type]
        )
        rates[policy] = sum(_lease_all(cache, trace)) / len(trace)
    assert rates["tinylfu"] >= rates["lru"] - 0.02


def test_the_window_climbs_while_the_hit_rate_improves_and_turns_back_when_it_drops() -> None:
    climber = WindowClimber(1000, initial_fraction=0.1, step_fraction=0.05, minimum_sample=10)
    hits = misses = 0
    windows = [climber.window_bytes]
    for rate in (0.5, 0.6, 0.7, 0.6):  # 10 requests a sample
        hits, misses = hits + int(rate * 10), misses + 10 - int(rate * 10)
        climber.observe(hits=hits, misses=misses, entries=1)
        windows.append(climber.window_bytes)
    # First sample sets the baseline; +0.1 twice (a jump: full step), then -0.1 turns back.
    assert windows == [100, 100, 150, 200, 150]
    climber.observe(hits=hits + 1, misses=misses, entries=1)  # not a whole sample yet
    assert climber.window_bytes == 150


def test_a_prefetched_expert_waits_for_its_request_instead_of_losing_a_contest() -> None:
    loader = FakeLoader({i: 10 for i in range(10)})
    cache: ExpertCache[str] = ExpertCache(40, loader, policy="tinylfu")
    _lease_all(cache, [0, 1, 2] * 3)  # popular
    assert cache.prefetch(5)  # its request is queued behind the one for 6
    # 5 has no count yet but wins its place: the least recently used popular expert (0) goes.
    assert _lease_all(cache, [6, 5]) == [False, True]
    assert loader.loads[5] == 1 and 0 not in cache.resident()
    assert {1, 2} <= set(cache.resident())


def test_a_prefetched_expert_whose_request_never_comes_is_not_kept_for_ever() -> None:
    loader = FakeLoader({i: 10 for i in range(100)})
    cache: ExpertCache[str] = ExpertCache(40, loader, policy="tinylfu")
    _lease_all(cache, [0, 1, 2] * 3)
    assert cache.prefetch(5)  # its request is cancelled: 5 is never leased
    _lease_all(cache, list(range(10, 60)))  # one-off requests
    assert {1, 2} <= set(cache.resident())
    # Once the popular experts were used again, 5 is the least recently used admitted expert,
    # and with no count it loses to the next newcomer.
    _lease_all(cache, [1, 2, 70, 71])
    assert 5 not in cache.resident() and {1, 2} <= set(cache.resident())


@pytest.mark.parametrize("forget", [False, True])
def test_after_forget_popularity_new_experts_displace_ones_no_longer_asked_for(
    forget: bool,
) -> None:
    # A store swap: experts 0-2 were popular under the old version and are never asked for
    # again; 10 and 11 are the new version's, asked for in turn.
    loader = FakeLoader({i: 10 for i in range(20)})
    cache: ExpertCache[str] = ExpertCache(40, loader, policy="tinylfu")
    _lease_all(cache, [0, 1, 2] * 20)
    if forget:
        cache.forget_popularity()
    hits = _lease_all(cache, [10, 11] * 10)
    if forget:
        assert hits[2:] == [True] * 18
        assert {10, 11} <= set(cache.resident())
    else:
        # Each newcomer loses its contest to an old expert with twenty accesses to its name.
        assert hits.count(True) <= 2
        assert {0, 1, 2} <= set(cache.resident())


def test_forget_popularity_keeps_every_expert_resident() -> None:
    loader = FakeLoader({i: 10 for i in range(5)})
    cache: ExpertCache[str] = ExpertCache(40, loader, policy="tinylfu")
    _lease_all(cache, [0, 1, 2, 3] * 3)
    before = set(cache.resident())
    cache.forget_popularity()
    assert set(cache.resident()) == before
    assert _lease_all(cache, sorted(before)) == [True] * len(before)


def test_a_small_cache_follows_a_shift_in_popularity_within_a_few_dozen_requests() -> None:
    # Counts age with the cache's size (20 accesses per cached expert between halvings): a
    # four-expert cache forgets an old hot set after ~100 requests, not after 1,000.
    loader = FakeLoader({i: 10 for i in range(20)})
    cache: ExpertCache[str] = ExpertCache(40, loader, policy="tinylfu")
    _lease_all(cache, [0, 1, 2] * 100)
    hits = _lease_all(cache, [10, 11, 12] * 40)
    assert sum(hits[-30:]) >= 27
