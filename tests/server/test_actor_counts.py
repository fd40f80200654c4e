"""Each actor's counters over the pool's life only grow, whatever its processes do."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from pool_support import IdGroup, IdPool

from experts_store import ExpertRef, Store
from server._settings import Settings
from server.pool import ActorReply, CacheCounts, FakeExpertPool
from server.pool._counts import ActorCounts

pytestmark = pytest.mark.unit

MakeStore = Callable[..., Path]


def test_a_restarted_process_whose_death_went_unseen_does_not_lower_the_counts() -> None:
    # After the Ray cluster was lost and came back, every actor was marked dead without its
    # counts kept; a restarted process's first reply then replaced them, and the Prometheus
    # counter fell (read as a reset, its increase lost).
    counts = ActorCounts()
    counts.replied("actor-0", CacheCounts(evictions=4, loads=10, load_bytes=1000), "p1")
    counts.replied("actor-0", CacheCounts(evictions=0, loads=3, load_bytes=300), "p2")
    assert counts.total("actor-0") == CacheCounts(evictions=4, loads=13, load_bytes=1300)
    counts.replied("actor-0", CacheCounts(evictions=1, loads=5, load_bytes=500), "p2")
    assert counts.total("actor-0") == CacheCounts(evictions=5, loads=15, load_bytes=1500)


def test_a_death_seen_keeps_the_counts_once() -> None:
    counts = ActorCounts()
    counts.replied("actor-0", CacheCounts(evictions=4, loads=10, load_bytes=1000), "p1")
    counts.died("actor-0")
    counts.replied("actor-0", CacheCounts(evictions=0, loads=3, load_bytes=300), "p2")
    assert counts.total("actor-0") == CacheCounts(evictions=4, loads=13, load_bytes=1300)
    assert counts.failures("actor-0") == {"died": 1, "hung": 0}


def one_actor(make_store: MakeStore) -> tuple[FakeExpertPool, IdPool, torch.Tensor]:
    """A one-actor fake pool on a small store, and rows for its experts."""
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    inner = FakeExpertPool(Settings(actors=1, cache_bytes=10**6))
    return inner, IdPool(store, inner), torch.ones(2, 3)


class HeldReplies(FakeExpertPool):
    """A fake pool whose first run reply is held until the test lets it go: replies of one
    process handled out of the order in which their counts were read (Ray's replies travel
    apart: a large one through the object store, a small one inline)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self._first = True

    async def _call_run(
        self, actor: str, payload: list[tuple[ExpertRef, np.ndarray]]
    ) -> ActorReply:
        reply = await super()._call_run(actor, payload)
        if self._first:
            self._first = False
            self.held.set()
            await self.release.wait()
        return reply


async def test_replies_of_one_process_handled_out_of_order_count_its_loads_once(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=4, n=3, width=6, out=2))
    inner = HeldReplies(Settings(actors=1, cache_bytes=10**6))
    pool = IdPool(store, inner)
    rows = torch.ones(2, 3)
    first = asyncio.create_task(pool.run([IdGroup(0, rows)]))  # reply counts 1 load
    await inner.held.wait()
    await pool.run([IdGroup(1, rows)])  # reply counts 2 loads, handled first
    inner.release.set()
    await first
    # The process loaded two experts; the late reply's older reading must not add it again.
    assert inner.core("actor-0").counts().loads == 2
    assert pool.actors()[0].counts.loads == 2
    await pool.close()


async def test_a_new_process_unseen_by_the_pool_adds_to_its_predecessors_counts(
    make_store: MakeStore,
) -> None:
    # An idle actor that Ray restarts (no socket to tell, as for an actor on another node)
    # is answered by its new process at the next call: the pool never saw the death.
    inner, pool, rows = one_actor(make_store)
    await pool.run([IdGroup(0, rows)])  # the first process: 1 load
    await inner._restart("actor-0")
    await pool.run([IdGroup(e, rows) for e in range(4)])  # the new one: 4 loads, unseen
    assert pool.actors()[0].counts.loads == 5
    await pool.close()


async def test_a_process_taken_for_dead_that_answers_again_is_not_counted_twice(
    make_store: MakeStore,
) -> None:
    # A call failed as if its actor had died (a dropped socket, Ray's ActorUnavailableError
    # on a network blip, a hung process whose kill never landed), and the same process
    # answered the revival: its counts were kept at the "death" and came back in its replies.
    inner, pool, rows = one_actor(make_store)
    await pool.run([IdGroup(0, rows)])
    inner._actor_died("actor-0")
    assert await pool.wait_until_alive("actor-0")
    await pool.run([IdGroup(1, rows)])
    assert inner.core("actor-0").counts().loads == 2
    assert pool.actors()[0].counts.loads == 2
    assert pool.actors()[0].failures == {"died": 1, "hung": 0}
    await pool.close()
