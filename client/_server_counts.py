"""The server's own cache counters, read from /metrics before and after a load test.

The load test's misses count (request, expert) waits: requests batched together share one
load and each counts it. The server counts each load once (`momlp_expert_loads_total`), so
the difference of two scrapes is what the run cost the actors, other clients' traffic
included.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from ._exceptions import MomlpError

if TYPE_CHECKING:
    from ._async_client import AsyncClient

__all__ = ["SERVER_COUNTERS", "Counters", "counter_delta", "parse_counters", "read_counters"]

# report key -> the /metrics series (one per actor, each counting since that actor started).
SERVER_COUNTERS = {
    "loads": "momlp_expert_loads_total",
    "load_bytes": "momlp_expert_load_bytes_total",
    "evictions": "momlp_cache_evictions_total",
}

_SAMPLE = re.compile(r'^(\w+)(?:\{actor="([^"]*)"\})? (\S+)')

Counters = dict[str, dict[str, int]]  # report key -> actor -> count


def parse_counters(text: str) -> Counters | None:
    """Each actor's counters in a /metrics text; None unless every series is there (an
    older server) and every value is a finite number."""
    wanted = {series: key for key, series in SERVER_COUNTERS.items()}
    found: Counters = {}
    for line in text.splitlines():
        sample = _SAMPLE.match(line)
        if sample is None or sample[1] not in wanted:
            continue
        try:
            number = float(sample[3])
        except ValueError:
            return None
        if not math.isfinite(number):
            return None
        found.setdefault(wanted[sample[1]], {})[sample[2] or ""] = int(number)
    return found if len(found) == len(SERVER_COUNTERS) else None


async def read_counters(client: AsyncClient) -> Counters | None:
    """The server's counters now, or None where /metrics cannot be read (a gateway, say)."""
    try:
        return parse_counters(await client.metrics())
    except MomlpError:
        return None


def counter_delta(before: Counters | None, after: Counters | None) -> dict[str, int] | None:
    """after - before, summed over the actors; None if either is missing or an actor's
    counter fell or vanished (it restarted, and what it did before is lost)."""
    if before is None or after is None:
        return None
    delta = {}
    for key in SERVER_COUNTERS:
        now = after[key]
        if any(now.get(actor, -1) < count for actor, count in before[key].items()):
            return None
        delta[key] = sum(now.values()) - sum(before[key].values())
    return delta
