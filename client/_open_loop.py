"""Did an open-loop load test send at the asked rate? The generator's own delay, per request.

In an open loop each request has a scheduled arrival (`RequestRecord.start_s`) and latency
counts from it, so a generator that falls behind (its event loop busy, or all of its clients
waiting on answers) neither lowers the rate it reports nor hides the wait: the wait lands in
the latency, and reads as the server's. These figures say how much of it was the generator's:
how long after its arrival each request actually left (`sent_s`), and at what rate they left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._figures import percentile
from ._records import RequestRecord

__all__ = ["LATE_MS", "open_loop_figures", "open_loop_notes"]

# A request that left this long after its arrival was late. Well above the send jitter of a
# generator that keeps up (p99 11 ms, max 18 ms at 250 req/s beside the server on the 2-core
# VM), far below the seconds it lags once it has fallen behind.
LATE_MS = 100.0


def open_loop_figures(records: Sequence[RequestRecord], rate: float) -> dict[str, Any]:
    """`LoadTestReport.open_loop`: the asked rate, the rates of the scheduled arrivals and of
    the sends (each over the time from the start to the last one), the delay from arrival to
    send (ms), how many requests left later than `LATE_MS` and how many never left."""
    sends = [(record.start_s, record.sent_s) for record in records if record.sent_s is not None]
    lags = [1000.0 * (sent_s - start_s) for start_s, sent_s in sends]
    last_arrival = max((record.start_s for record in records), default=0.0)
    last_send = max((sent_s for _, sent_s in sends), default=0.0)
    return {
        "rate": rate,
        "arrivals": len(records),
        "arrivals_per_s": len(records) / last_arrival if last_arrival > 0 else 0.0,
        "sent": len(sends),
        "sent_per_s": len(sends) / last_send if last_send > 0 else 0.0,
        "send_lag_ms": {
            "p50": percentile(lags, 50) if lags else 0.0,
            "p99": percentile(lags, 99) if lags else 0.0,
            "max": max(lags, default=0.0),
        },
        "late_ms": LATE_MS,
        "late": sum(1 for lag in lags if lag > LATE_MS),
        "unsent": len(records) - len(sends),
    }


def open_loop_notes(figures: dict[str, Any], *, in_flight_limit: int) -> list[str]:
    """One note when the generator fell behind its arrivals; none while it kept up."""
    late, unsent = figures["late"], figures["unsent"]
    if not late and not unsent:
        return []
    never = (
        f"; {unsent} never left (status client_busy: no client free within the timeout)"
        if unsent
        else ""
    )
    return [
        f"the generator fell behind its arrivals: {late} of {figures['arrivals']} requests "
        f"left more than {figures['late_ms']:g} ms after their scheduled arrival (up to "
        f"{figures['send_lag_ms']['max']:.0f} ms){never}; it sent {figures['sent_per_s']:.1f} "
        f"req/s of the {figures['rate']:g} asked. Latency counts from the arrival, so the "
        f"latency figures include that delay. It holds at most {in_flight_limit} requests in "
        "flight: all of them waiting on the server, or its CPU busy, hold the next ones back."
    ]
