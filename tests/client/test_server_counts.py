"""The server's load counters read from /metrics text, and their change over a run."""

from __future__ import annotations

import pytest

from client._server_counts import counter_delta, parse_counters

pytestmark = pytest.mark.unit

TEXT = """\
# HELP momlp_expert_loads_total experts loaded into each actor's cache
# TYPE momlp_expert_loads_total counter
momlp_expert_loads_total{actor="actor-0"} 900.0
momlp_expert_loads_total{actor="actor-1"} 794.0
momlp_expert_load_bytes_total{actor="actor-0"} 5.06908800e+08
momlp_expert_load_bytes_total{actor="actor-1"} 4.47222208e+08
momlp_cache_evictions_total{actor="actor-0"} 880.0
momlp_cache_evictions_total{actor="actor-1"} 770.0
momlp_cache_misses_total 1753.0
momlp_resident_bytes{actor="actor-0"} 1.1e+07
"""


def test_each_actors_counters_are_read_from_the_metrics_text():
    assert parse_counters(TEXT) == {
        "loads": {"actor-0": 900, "actor-1": 794},
        "load_bytes": {"actor-0": 506_908_800, "actor-1": 447_222_208},
        "evictions": {"actor-0": 880, "actor-1": 770},
    }


@pytest.mark.parametrize(
    "text",
    [
        TEXT.replace("momlp_expert_loads_total", "momlp_other_total"),  # an older server
        TEXT.replace("880.0", "NaN"),
        TEXT.replace("880.0", "many"),
        "",
    ],
)
def test_a_text_without_every_counter_gives_none(text):
    assert parse_counters(text) is None


def counts(loads: dict[str, int]) -> dict[str, dict[str, int]]:
    return {"loads": loads, "load_bytes": {a: 10 * n for a, n in loads.items()},
            "evictions": {a: n // 2 for a, n in loads.items()}}


def test_the_delta_is_after_minus_before_summed_over_the_actors():
    before = counts({"actor-0": 10, "actor-1": 4})
    after = counts({"actor-0": 25, "actor-1": 9})
    assert counter_delta(before, after) == {"loads": 20, "load_bytes": 200, "evictions": 9}
    assert counter_delta(None, after) is None
    assert counter_delta(before, None) is None


def test_an_actor_that_restarted_makes_the_change_unknown_even_when_the_sum_grew():
    # actor-1 restarted and counts from zero again; actor-0's loads outweigh its fall.
    before = counts({"actor-0": 10, "actor-1": 4})
    assert counter_delta(before, counts({"actor-0": 30, "actor-1": 1})) is None
    assert counter_delta(before, counts({"actor-0": 30})) is None
    # An actor that appears during the run counts from zero.
    assert counter_delta(before, counts({"actor-0": 10, "actor-1": 4, "actor-2": 3})) == {
        "loads": 3, "load_bytes": 30, "evictions": 1
    }
