"""The server's load counters read from /metrics text, and their change over a run."""

from __future__ import annotations

import pytest

from client._server_counts import counter_delta, parse_counters

pytestmark = pytest.mark.unit

TEXT = """\
# HELP momlp_expert_loads_total experts loaded into actor caches
# TYPE momlp_expert_loads_total counter
momlp_expert_loads_total 1694.0
momlp_expert_load_bytes_total 9.54131008e+08
momlp_cache_evictions_total 1650.0
momlp_cache_misses_total 1753.0
momlp_resident_bytes{actor="actor-0"} 1.1e+07
"""


def test_the_counters_are_read_from_the_metrics_text():
    assert parse_counters(TEXT) == {
        "loads": 1694, "load_bytes": 954_131_008, "evictions": 1650
    }


@pytest.mark.parametrize(
    "text",
    [
        TEXT.replace("momlp_expert_loads_total 1694.0\n", ""),  # a server without the series
        TEXT.replace("1650.0", "NaN"),
        TEXT.replace("1650.0", "many"),
        "",
    ],
)
def test_a_text_without_every_counter_gives_none(text):
    assert parse_counters(text) is None


def test_the_delta_is_after_minus_before_and_none_when_a_counter_fell():
    before = {"loads": 10, "load_bytes": 1000, "evictions": 4}
    after = {"loads": 25, "load_bytes": 2500, "evictions": 19}
    assert counter_delta(before, after) == {"loads": 15, "load_bytes": 1500, "evictions": 15}
    # An actor that restarted counts from zero again: the change is unknown, not negative.
    assert counter_delta(after, before) is None
    assert counter_delta(None, after) is None
    assert counter_delta(before, None) is None
