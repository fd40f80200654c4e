"""The figures computed from load-test records: percentiles, latency summary, per-second series."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from ._records import RequestRecord

__all__ = [
    "LATENCY_PERCENTILES",
    "finite",
    "latency_summary",
    "percentile",
    "rate",
    "ratio",
    "time_series",
]

# Keys of `latency_ms` beside max and mean, with the percentile each names.
LATENCY_PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99.9": 99.9}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); nan if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def time_series(
    records: Iterable[RequestRecord], *, duration_s: float | None = None
) -> list[dict[str, Any]]:
    """Per-second buckets by completion time; resident bytes are the last seen per actor.

    `offered` counts the requests that started (in open loop: were scheduled to arrive) in
    that second, so a second in which the server answered nothing still has its bucket;
    `sent` those that left the generator in it (fewer than `offered` when it fell behind).
    Rates divide by the part of the second the run covered, so a last, partial second does
    not read as a throughput drop.
    """
    records = list(records)
    buckets: dict[int, list[RequestRecord]] = defaultdict(list)
    offered: Counter[int] = Counter()
    sent: Counter[int] = Counter()
    for record in records:
        buckets[int(math.floor(record.end_s))].append(record)
        offered[int(math.floor(max(record.start_s, 0.0)))] += 1
        if record.sent_s is not None:
            sent[int(math.floor(max(record.sent_s, 0.0)))] += 1
    series = []
    for second in sorted(set(buckets) | set(offered) | set(sent)):
        bucket = sorted(buckets[second], key=lambda record: record.end_s)
        ok = [record for record in bucket if record.ok]
        latencies = [record.latency_ms for record in ok]
        hits = sum(record.hits for record in ok)
        misses = sum(record.misses for record in ok)
        device: dict[str, int] = {}
        for record in ok:
            device.update(record.device_bytes)
        rows = sum(record.rows for record in ok)
        span = 1.0
        if duration_s is not None and second + 1 > duration_s > second:
            span = duration_s - second
        series.append(
            {
                "t": second,
                "requests": len(ok),
                "errors": len(bucket) - len(ok),
                "offered": offered[second],
                "sent": sent[second],
                "rows": rows,
                "requests_per_s": len(ok) / span,
                "offered_per_s": offered[second] / span,
                "sent_per_s": sent[second] / span,
                "rows_per_s": rows / span,
                "latency_ms": {
                    "p50": finite(percentile(latencies, 50)),
                    "p90": finite(percentile(latencies, 90)),
                    "p99": finite(percentile(latencies, 99)),
                },
                "hits": hits,
                "misses": misses,
                "hit_rate": ratio(hits, hits + misses),
                "device_bytes": device,
            }
        )
    return series


def latency_summary(latencies: Sequence[float]) -> dict[str, float]:
    """`latency_ms` of report.json: the `LATENCY_PERCENTILES`, max and mean (0 when empty)."""
    summary = {key: finite(percentile(latencies, q)) for key, q in LATENCY_PERCENTILES.items()}
    summary["max"] = max(latencies, default=0.0)
    summary["mean"] = sum(latencies) / len(latencies) if latencies else 0.0
    return summary


def finite(value: float) -> float:
    # JSON has no NaN: an empty set of samples reads as 0 (with ok = 0 beside it).
    return value if math.isfinite(value) else 0.0


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None
