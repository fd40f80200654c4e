from __future__ import annotations

import random
import threading
from collections import OrderedDict
from contextlib import ExitStack

import pytest
from cache_helpers import FakeClock, FakeLoader, wait_until

from experts_store import CacheBusy, ExpertCache, ExpertTooLarge, Lease

pytestmark = pytest.mark.unit


def test_hits_misses_and_lru_eviction() -> None:
    clock = FakeClock()
    loader = FakeLoader({0: 40, 1: 40, 2: 40}, clock)
    cache: ExpertCache[str] = ExpertCache(100, loader, clock=clock)
    with cache.lease(0) as lease:
        assert lease == Lease(0, "expert-0", False, 0.5, 40)
    with cache.lease(1):
        pass
    with cache.lease(0) as lease:
        assert lease.hit and lease.value == "expert-0" and lease.load_seconds == 0.0
    with cache.lease(2):
        pass
    assert list(cache.resident()) == [0, 2]
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.loads, stats.evictions) == (1, 3, 3, 1)
    assert stats.bytes_loaded == 120 and stats.load_seconds == 1.5
    assert cache.resident_bytes == 80 and cache.reserved_bytes == 0


def test_randomized_gets_never_exceed_budget_and_match_a_reference_lru() -> None:
    rng = random.Random(1234)
    sizes = {i: rng.choice([1, 3, 7, 20, 45]) for i in range(60)}
    budget = 100
    loader = FakeLoader(sizes)
    cache: ExpertCache[str] = ExpertCache(budget, loader, clock=FakeClock())
    reference: OrderedDict[int, int] = OrderedDict()
    held: dict[int, ExitStack] = {}
    for _ in range(10_000):
        expert_id = rng.randrange(60)
        if held and rng.random() < 0.3:
            released = rng.choice(list(held))
            held.pop(released).close()
        stack = ExitStack()
        pinned = set(held)
        try:
            lease = stack.enter_context(cache.lease(expert_id, timeout=0))
        except CacheBusy:
            # Only when the unpinned experts cannot make room, as the reference agrees.
            evictable = sum(n for i, n in reference.items() if i not in pinned)
            assert budget - sum(reference.values()) + evictable < sizes[expert_id]
            continue
        if expert_id in reference:
            assert lease.hit
            reference.move_to_end(expert_id)
        else:
            assert not lease.hit
            for victim in [i for i in reference if i not in pinned]:
                if budget - sum(reference.values()) >= sizes[expert_id]:
                    break
                del reference[victim]
            reference[expert_id] = sizes[expert_id]
        if rng.random() < 0.2 and expert_id not in held:
            held[expert_id] = stack
        else:
            stack.close()
        resident = cache.resident()
        assert cache.resident_bytes + cache.reserved_bytes <= budget
        assert cache.used_bytes == cache.resident_bytes + cache.reserved_bytes
        assert sum(resident.values()) == cache.resident_bytes
        assert set(held) <= set(resident)
        assert list(resident) == list(reference)
    stats = cache.stats
    assert stats.loads == stats.misses == sum(loader.loads.values())
    assert stats.evictions == stats.loads - len(cache.resident())


def test_concurrent_leases_under_pressure_keep_the_budget() -> None:
    rng = random.Random(7)
    sizes = {i: rng.choice([5, 10, 30]) for i in range(20)}
    loader = FakeLoader(sizes)
    cache: ExpertCache[str] = ExpertCache(60, loader)
    violations: list[str] = []

    def check() -> None:
        # One atomic read: summing two properties could mix states from either side of an
        # eviction plus reservation made by another thread.
        if cache.used_bytes > 60:
            violations.append("over budget")

    loader.check = check

    def worker(seed: int) -> None:
        local = random.Random(seed)
        for _ in range(300):
            expert_id = local.randrange(20)
            with cache.lease(expert_id, timeout=None) as lease:
                if expert_id not in cache.resident() or lease.value != f"expert-{expert_id}":
                    violations.append(f"leased expert {expert_id} not resident")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert violations == []
    assert cache.reserved_bytes == 0 and cache.leased() == {}


def test_concurrent_leases_of_a_missing_expert_load_it_once() -> None:
    loader = FakeLoader({0: 10})
    loader.gates[0] = threading.Event()
    loader.started[0] = threading.Event()
    cache: ExpertCache[str] = ExpertCache(100, loader)
    results: list[Lease[str]] = []

    def lease() -> None:
        with cache.lease(0) as held:
            results.append(held)

    threads = [threading.Thread(target=lease) for _ in range(3)]
    threads[0].start()
    assert loader.started[0].wait(10)
    for t in threads[1:]:
        t.start()
    wait_until(lambda: cache.waiting == 2)
    assert cache.stats.misses == 3
    assert cache.reserved_bytes == 10
    loader.gates[0].set()
    for t in threads:
        t.join()
    assert loader.loads == {0: 1}
    assert [r.value for r in results] == ["expert-0"] * 3
    assert not any(r.hit for r in results)


def test_failing_load_frees_its_reservation_and_raises_to_every_waiter() -> None:
    loader = FakeLoader({0: 10})
    loader.fail.add(0)
    loader.gates[0] = threading.Event()
    loader.started[0] = threading.Event()
    cache: ExpertCache[str] = ExpertCache(100, loader)
    errors: list[BaseException] = []

    def lease() -> None:
        try:
            with cache.lease(0):
                pass
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=lease) for _ in range(2)]
    threads[0].start()
    assert loader.started[0].wait(10)
    threads[1].start()
    wait_until(lambda: cache.waiting == 1)
    loader.gates[0].set()
    for t in threads:
        t.join()
    assert len(errors) == 2 and all("expert 0" in str(e) for e in errors)
    assert cache.reserved_bytes == 0 and cache.resident() == {}
    loader.fail.clear()
    with cache.lease(0) as held:
        assert held.value == "expert-0"
    assert loader.loads == {0: 2}


def test_expert_larger_than_the_budget() -> None:
    cache: ExpertCache[str] = ExpertCache(100, FakeLoader({0: 101, 1: 60}), max_entry_bytes=50)
    with pytest.raises(ExpertTooLarge) as info:
        with cache.lease(0):
            pass
    assert info.value.expert_id == 0 and info.value.nbytes == 101
    with pytest.raises(ExpertTooLarge):
        with cache.lease(1):
            pass


def test_leased_experts_are_never_evicted_and_busy_is_reported() -> None:
    cache: ExpertCache[str] = ExpertCache(100, FakeLoader({0: 60, 1: 60, 2: 30}))
    with cache.lease(0):
        with pytest.raises(CacheBusy) as info:
            with cache.lease(1, timeout=0):
                pass
        assert info.value.expert_id == 1
        assert not cache.prefetch(1)
        assert not cache.evict(0)
        cache.clear()
        assert cache.resident() == {0: 60}
        with cache.lease(2):
            assert cache.resident() == {0: 60, 2: 30}
    assert cache.evict(0)
    assert cache.resident() == {2: 30}


def test_a_waiting_lease_proceeds_when_room_frees() -> None:
    cache: ExpertCache[str] = ExpertCache(100, FakeLoader({0: 60, 1: 60}))
    got: list[str] = []
    release = threading.Event()
    holding = threading.Event()

    def holder() -> None:
        with cache.lease(0):
            holding.set()
            assert release.wait(10)

    def waiter() -> None:
        with cache.lease(1, timeout=None) as lease:
            got.append(lease.value)

    a = threading.Thread(target=holder)
    a.start()
    assert holding.wait(10)
    b = threading.Thread(target=waiter)
    b.start()
    wait_until(lambda: cache.waiting == 1)
    assert got == []
    release.set()
    a.join()
    b.join()
    assert got == ["expert-1"]
    assert cache.resident() == {1: 60}


def test_prefetch_loads_when_room_can_be_made() -> None:
    loader = FakeLoader({0: 50, 1: 50, 2: 50})
    cache: ExpertCache[str] = ExpertCache(100, loader)
    assert cache.prefetch(0) and cache.prefetch(1)
    assert cache.prefetch(1)
    assert loader.loads == {0: 1, 1: 1}
    with cache.lease(1) as lease:
        assert lease.hit
        assert cache.prefetch(2)
        assert cache.resident() == {1: 50, 2: 50}
    loader.fail.add(0)
    assert not cache.prefetch(0)
    assert cache.reserved_bytes == 0
