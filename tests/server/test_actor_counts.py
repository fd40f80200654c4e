"""Each actor's counters over the pool's life only grow, whatever its processes do."""

from __future__ import annotations

import pytest

from server.pool import CacheCounts
from server.pool._counts import ActorCounts

pytestmark = pytest.mark.unit


def test_a_restarted_process_whose_death_went_unseen_does_not_lower_the_counts() -> None:
    # After the Ray cluster was lost and came back, every actor was marked dead without its
    # counts kept; a restarted process's first reply then replaced them, and the Prometheus
    # counter fell (read as a reset, its increase lost).
    counts = ActorCounts()
    counts.replied("actor-0", CacheCounts(evictions=4, loads=10, load_bytes=1000))
    counts.replied("actor-0", CacheCounts(evictions=0, loads=3, load_bytes=300))
    assert counts.total("actor-0") == CacheCounts(evictions=4, loads=13, load_bytes=1300)
    counts.replied("actor-0", CacheCounts(evictions=1, loads=5, load_bytes=500))
    assert counts.total("actor-0") == CacheCounts(evictions=5, loads=15, load_bytes=1500)


def test_a_death_seen_keeps_the_counts_once() -> None:
    counts = ActorCounts()
    counts.replied("actor-0", CacheCounts(evictions=4, loads=10, load_bytes=1000))
    counts.died("actor-0")
    counts.replied("actor-0", CacheCounts(evictions=0, loads=3, load_bytes=300))
    assert counts.total("actor-0") == CacheCounts(evictions=4, loads=13, load_bytes=1300)
    assert counts.failures("actor-0") == {"died": 1, "hung": 0}
