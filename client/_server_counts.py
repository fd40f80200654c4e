"""The server's own cache counters, read from /metrics before and after a load test.

The load test's misses count (request, expert) waits: requests batched together share one
load and each counts it. The server counts each load once (`momlp_expert_loads_total`), so
the difference of two scrapes is what the run cost the actors, other clients' traffic
included.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._exceptions import MomlpError

if TYPE_CHECKING:
    from ._async_client import AsyncClient

__all__ = ["SERVER_COUNTERS", "counter_delta", "parse_counters", "read_counters"]

# report key -> the /metrics series (each a sum over the actors since each last started).
SERVER_COUNTERS = {
    "loads": "momlp_expert_loads_total",
    "load_bytes": "momlp_expert_load_bytes_total",
    "evictions": "momlp_cache_evictions_total",
}


def parse_counters(text: str) -> dict[str, int] | None:
    """The counters of a /metrics text; None unless every one is there (an older server)."""
    wanted = {series: key for key, series in SERVER_COUNTERS.items()}
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = wanted.get(name)
        if key is None:
            continue
        try:
            number = float(value.split()[0])
        except (IndexError, ValueError):
            return None
        if not math.isfinite(number):
            return None
        found[key] = int(number)
    return found if len(found) == len(SERVER_COUNTERS) else None


async def read_counters(client: AsyncClient) -> dict[str, int] | None:
    """The server's counters now, or None where /metrics cannot be read (a gateway, say)."""
    try:
        return parse_counters(await client.metrics())
    except MomlpError:
        return None


def counter_delta(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, int] | None:
    """after - before; None if either is missing or a counter fell (an actor restarted)."""
    if before is None or after is None:
        return None
    delta = {key: after[key] - before[key] for key in SERVER_COUNTERS}
    return delta if min(delta.values()) >= 0 else None
