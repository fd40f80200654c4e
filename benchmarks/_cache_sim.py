"""Cache policies replayed on request traces, for `pool.py`'s hit rates: the traces (Zipf,
shifting, bursty), the pool's `ExpertCache` on them (one cache, or one per actor as the
pool's rendezvous hashing partitions them), and the references it is compared with (a
textbook LRU, Belady's optimum, perfect LFU, LRU protecting the queued work)."""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np

from experts_store import CachePolicy, ExpertCache
from server.pool import rendezvous_rank

__all__ = [
    "belady_hits",
    "bursty_trace",
    "cache_hits",
    "lfu_hits",
    "lookahead_lru_hits",
    "lru_reference_hits",
    "partitioned_hits",
    "shifting_trace",
    "zipf_trace",
]


def zipf_trace(num_experts: int, length: int, s: float, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_experts + 1) ** s
    ranks = rng.choice(num_experts, size=length, p=weights / weights.sum())
    ids = rng.permutation(num_experts)  # popularity unrelated to id (and to hashing)
    return [int(ids[r]) for r in ranks]


class _UnitLoader:
    """Every expert costs 1 byte and loads instantly: only the policy is measured."""

    def nbytes(self, expert_id: int) -> int:
        return 1

    def load(self, expert_id: int) -> int:
        return expert_id


def cache_hits(trace: list[int], capacity: int, policy: CachePolicy) -> int:
    cache: ExpertCache[int] = ExpertCache(capacity, _UnitLoader(), policy=policy)
    for expert_id in trace:
        with cache.lease(expert_id):
            pass
    return cache.stats.hits


def partitioned_hits(trace: list[int], capacity: int, actors: int, policy: CachePolicy) -> int:
    names = [f"actor-{i}" for i in range(actors)]
    caches = {
        name: ExpertCache(capacity // actors, _UnitLoader(), policy=policy) for name in names
    }
    for expert_id in trace:
        with caches[rendezvous_rank(expert_id, names)[0]].lease(expert_id):
            pass
    return sum(c.stats.hits for c in caches.values())


def lru_reference_hits(trace: list[int], capacity: int) -> int:
    """An independent textbook LRU, to check the cache's own count."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for expert_id in trace:
        if expert_id in lru:
            hits += 1
            lru.move_to_end(expert_id)
        else:
            if len(lru) >= capacity:
                lru.popitem(last=False)
            lru[expert_id] = None
    return hits


def belady_hits(trace: list[int], capacity: int) -> int:
    """Demand paging with the optimal victim: the resident expert used furthest in the future."""
    never = len(trace) + 1
    next_use = [never] * len(trace)
    seen: dict[int, int] = {}
    for t in range(len(trace) - 1, -1, -1):
        next_use[t] = seen.get(trace[t], never)
        seen[trace[t]] = t
    resident: dict[int, int] = {}  # expert -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, expert), stale entries skipped
    hits = 0
    for t, expert_id in enumerate(trace):
        if expert_id in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                negative, victim = heapq.heappop(heap)
                if resident.get(victim) == -negative:
                    del resident[victim]
                    break
        resident[expert_id] = next_use[t]
        heapq.heappush(heap, (-next_use[t], expert_id))
    return hits


def lfu_hits(trace: list[int], capacity: int) -> int:
    """Online perfect-LFU (counts every past request), for comparison with LRU: under a fixed
    Zipf popularity it approaches the best any online policy can do."""
    counts: dict[int, int] = {}
    resident: set[int] = set()
    hits = 0
    for expert_id in trace:
        counts[expert_id] = counts.get(expert_id, 0) + 1
        if expert_id in resident:
            hits += 1
            continue
        if len(resident) >= capacity:
            resident.remove(min(resident, key=counts.__getitem__))
        resident.add(expert_id)
    return hits


def lookahead_lru_hits(trace: list[int], capacity: int, window: int) -> int:
    """LRU that never evicts an expert needed by the next `window` requests (unless every
    resident one is): what knowing the queued work could add to the pool's LRU."""
    lru: OrderedDict[int, None] = OrderedDict()
    upcoming: dict[int, int] = {}
    for expert_id in trace[1 : 1 + window]:
        upcoming[expert_id] = upcoming.get(expert_id, 0) + 1
    hits = 0
    for t, expert_id in enumerate(trace):
        if expert_id in lru:
            hits += 1
            lru.move_to_end(expert_id)
        else:
            if len(lru) >= capacity:
                victim = next((e for e in lru if not upcoming.get(e)), next(iter(lru)))
                del lru[victim]
            lru[expert_id] = None
        if window and t + 1 < len(trace):  # slide the window to t+2 .. t+1+window
            upcoming[trace[t + 1]] -= 1
        if window and t + 1 + window < len(trace):
            upcoming[trace[t + 1 + window]] = upcoming.get(trace[t + 1 + window], 0) + 1
    return hits


def shifting_trace(num_experts: int, length: int, every: int) -> list[int]:
    """Zipf(1.0) whose ranking is drawn anew every `every` requests."""
    trace: list[int] = []
    for phase in range(length // every):
        trace += zipf_trace(num_experts, every, 1.0, seed=phase + 1)
    return trace


def bursty_trace(num_experts: int, length: int, seed: int, sessions: int = 50) -> list[int]:
    """Session traffic: Zipf(1.0) picks a session's expert; a session asks for it a geometric
    number of times (mean 8), interleaved with the other open sessions."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_experts + 1)
    ids = rng.permutation(num_experts)
    starts = iter(rng.choice(num_experts, size=length, p=weights / weights.sum()))
    active: list[list[int]] = []
    trace: list[int] = []
    while len(trace) < length:
        while len(active) < sessions:
            active.append([int(ids[next(starts)]), int(rng.geometric(1 / 8))])
        index = int(rng.integers(len(active)))
        trace.append(active[index][0])
        active[index][1] -= 1
        if active[index][1] <= 0:
            active.pop(index)
    return trace
