"""Load-test records, the figures computed from them, report.json and the terminal summary."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CSV_COLUMNS",
    "LATENCY_PERCENTILES",
    "LoadTestReport",
    "RequestRecord",
    "build_report",
    "percentile",
    "write_records_csv",
]

# Keys of `latency_ms` beside max and mean, with the percentile each names.
LATENCY_PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99.9": 99.9}


@dataclass(frozen=True)
class RequestRecord:
    """One request of the load test; times are seconds since the test started."""

    index: int
    start_s: float
    end_s: float
    rows: int
    # "200", another HTTP status, connect / timeout / network / protocol / decoding, or
    # client_busy (never sent: no client of the generator's came free within the timeout).
    status: str
    hits: int = 0
    misses: int = 0
    vram_bytes: int | None = None
    device_bytes: dict[str, int] = field(default_factory=dict)
    expert_rows: dict[int, int] = field(default_factory=dict)
    kept: int = 0  # experts used, summed over the request's rows (the gate may vary it)
    # Kind hyper: the cache keys of the θ the request's rows used (one per distinct condition).
    condition_keys: tuple[str, ...] = ()
    # --eval: sum of squared errors (regression) or correct rows (classification), and over
    # how many values (output values, or rows); None without --eval.
    eval_sum: float | None = None
    eval_count: int = 0
    # When the request left the generator (None: it never did); start_s is its scheduled
    # arrival in an open loop, so sent_s - start_s is the generator's own delay.
    sent_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def latency_ms(self) -> float:
        return (self.end_s - self.start_s) * 1000.0


@dataclass(frozen=True)
class LoadTestReport:
    """Everything report.json holds; `to_dict()` is exactly its content."""

    requests: int
    ok: int
    errors: int
    rows: int
    duration_s: float
    requests_per_s: float
    rows_per_s: float
    latency_ms: dict[str, float]
    errors_by_status: dict[str, int]
    hits: int
    misses: int
    hit_rate: float | None
    loads: int
    vram_bytes: dict[str, float]
    dense_equivalent_bytes: int
    vram_ratio: float | None
    max_expert_bytes: int
    expert_rows: dict[str, int]
    time_series: list[dict[str, Any]]
    config: dict[str, Any]
    model: dict[str, Any]
    workload: dict[str, Any]
    records: list[dict[str, Any]] | None = None
    # Mean experts per answered row (what the gate kept).
    experts_per_row: float | None = None
    # Kind hyper: distinct θ (conditions) the answered requests used; None for other kinds.
    conditions_served: int | None = None
    # --eval: {"metric": "mse"|"accuracy", "value", "task", "rows", "values", "data"}.
    accuracy: dict[str, Any] | None = None
    # The server's own counters over the run, from /metrics ({"loads", "load_bytes",
    # "evictions"}; each load once, however many requests waited for it; other clients'
    # traffic included). None where /metrics could not be read or an actor restarted.
    server_counts: dict[str, int] | None = None
    # Open loop (`config["rate"]`): whether the generator sent at the asked rate
    # (`client._open_loop.open_loop_figures`); None in a closed loop.
    open_loop: dict[str, Any] | None = None
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.records is None:
            del data["records"]
        return data

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "report.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        return path

    def summary(self) -> str:
        lat = self.latency_ms
        vram = self.vram_bytes
        lines = [
            f"requests {self.requests} (ok {self.ok}, errors {self.errors}), rows {self.rows}, "
            f"{self.duration_s:.2f} s",
            f"throughput {self.requests_per_s:.1f} req/s, {self.rows_per_s:.1f} rows/s",
            "latency ms  "
            + "  ".join(f"{key} {lat[key]:.2f}" for key in LATENCY_PERCENTILES)
            + f"  max {lat['max']:.2f}  mean {lat['mean']:.2f}",
            # A miss is a (request, expert) pair that waited for a load; requests batched
            # together can share one load, so misses can exceed the server's loads.
            f"cache hits {self.hits}, misses (waited for a load) {self.misses}, hit rate "
            + ("n/a" if self.hit_rate is None else f"{self.hit_rate:.3f}"),
            f"vram/request  p50 {_human_bytes(vram['p50'])}  p99 {_human_bytes(vram['p99'])}  "
            f"max {_human_bytes(vram['max'])}; {self._memory_beside()}",
            self._served(),
        ]
        if self.server_counts is not None:
            server = self.server_counts
            # A hyper store's caches hold generated θ and the hypernetworks, not experts.
            loaded = "θ and hypernetworks" if self.model.get("kind") == "hyper" else "experts"
            lines.insert(
                4,
                f"server (/metrics, all traffic): loaded {server['loads']} {loaded} "
                f"({_human_bytes(server['load_bytes'])}), evicted {server['evictions']}",
            )
        if self.open_loop is not None:
            # Beside the throughput it explains: what the generator itself sent.
            lines.insert(2, _open_loop_line(self.open_loop))
        if self.accuracy is not None:
            value = self.accuracy["value"]
            lines.append(
                f"{self.accuracy['metric']} {'n/a' if value is None else f'{value:.6g}'} over "
                f"{self.accuracy['rows']} answered rows of {self.accuracy['data']}, beside "
                f"vram/request p50 {_human_bytes(vram['p50'])}"
            )
        if self.errors_by_status:
            counts = ", ".join(f"{key}: {value}" for key, value in self.errors_by_status.items())
            lines.append(f"errors by status: {counts}")
        lines.extend(self.notes)
        return "\n".join(lines)

    def _conditions_run(self) -> bool:
        # A --conditions run: rows carry random conditions, so there are no experts to count
        # and no dense model to compare with (every θ is generated on demand).
        return self.conditions_served is not None and "conditions" in self.workload

    def _memory_beside(self) -> str:
        hyper = self.model.get("hyper")
        if self._conditions_run() and isinstance(hyper, dict):
            return (
                f"the pinned hypernetwork {_human_bytes(hyper.get('generator_bytes', 0))} "
                f"+ θ {_human_bytes(hyper.get('theta_bytes', 0))} per condition"
            )
        return (
            f"dense model {_human_bytes(self.dense_equivalent_bytes)}; p99/dense "
            + ("n/a" if self.vram_ratio is None else f"{self.vram_ratio:.4f}")
        )

    def _served(self) -> str:
        if self._conditions_run():
            return (
                f"conditions served {self.conditions_served} distinct θ "
                f"(of {self.workload.get('distinct_drawn', '?')} drawn, from a table of "
                f"{self.workload['conditions']})"
            )
        served = f"experts served {len(self.expert_rows)} of {self.model.get('num_experts', '?')}"
        if self.experts_per_row is None:
            return served
        return f"{served}, {self.experts_per_row:.3f} per row"


def _open_loop_line(figures: dict[str, Any]) -> str:
    lag = figures["send_lag_ms"]
    return (
        f"open loop: asked {figures['rate']:g} req/s, arrivals {figures['arrivals_per_s']:.1f}/s, "
        f"sent {figures['sent_per_s']:.1f}/s; sent after the arrival p50 {lag['p50']:.1f} ms  "
        f"p99 {lag['p99']:.1f} ms  max {lag['max']:.1f} ms"
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); nan if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def build_report(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    dense_equivalent_bytes: int,
    max_expert_bytes: int,
    config: dict[str, Any],
    model: dict[str, Any],
    workload: dict[str, Any],
    save_requests: bool = False,
    accuracy: dict[str, Any] | None = None,
    server_counts: dict[str, int] | None = None,
) -> LoadTestReport:
    ok = [record for record in records if record.ok]
    latencies = [record.latency_ms for record in ok]
    vram = [float(record.vram_bytes) for record in ok if record.vram_bytes is not None]
    hits = sum(record.hits for record in ok)
    misses = sum(record.misses for record in ok)
    rows = sum(record.rows for record in ok)
    expert_rows: Counter[int] = Counter()
    for record in ok:
        expert_rows.update(record.expert_rows)
    errors = Counter(record.status for record in records if not record.ok)
    p99_vram = percentile(vram, 99)
    conditions = {key for record in ok for key in record.condition_keys}
    return LoadTestReport(
        requests=len(records),
        ok=len(ok),
        errors=len(records) - len(ok),
        rows=rows,
        duration_s=duration_s,
        requests_per_s=_rate(len(ok), duration_s),
        rows_per_s=_rate(rows, duration_s),
        latency_ms=_latency_summary(latencies),
        errors_by_status=dict(sorted(errors.items())),
        hits=hits,
        misses=misses,
        hit_rate=_ratio(hits, hits + misses),
        loads=misses,
        vram_bytes={
            "p50": _finite(percentile(vram, 50)),
            "p99": _finite(p99_vram),
            "max": max(vram, default=0.0),
        },
        dense_equivalent_bytes=dense_equivalent_bytes,
        vram_ratio=(
            p99_vram / dense_equivalent_bytes if vram and dense_equivalent_bytes > 0 else None
        ),
        max_expert_bytes=max_expert_bytes,
        expert_rows={str(key): value for key, value in sorted(expert_rows.items())},
        time_series=time_series(records, duration_s=duration_s),
        config=config,
        model=model,
        workload=workload,
        records=[_record_dict(record) for record in records] if save_requests else None,
        experts_per_row=sum(record.kept for record in ok) / rows if rows else None,
        conditions_served=len(conditions) if conditions else None,
        accuracy=accuracy,
        server_counts=server_counts,
    )


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
                    "p50": _finite(percentile(latencies, 50)),
                    "p90": _finite(percentile(latencies, 90)),
                    "p99": _finite(percentile(latencies, 99)),
                },
                "hits": hits,
                "misses": misses,
                "hit_rate": _ratio(hits, hits + misses),
                "device_bytes": device,
            }
        )
    return series


def _latency_summary(latencies: Sequence[float]) -> dict[str, float]:
    summary = {key: _finite(percentile(latencies, q)) for key, q in LATENCY_PERCENTILES.items()}
    summary["max"] = max(latencies, default=0.0)
    summary["mean"] = sum(latencies) / len(latencies) if latencies else 0.0
    return summary


CSV_COLUMNS = (
    "index",
    "start_s",
    "end_s",
    "latency_ms",
    "rows",
    "status",
    "hits",
    "misses",
    "vram_bytes",
    "expert_rows",
    "sent_s",  # last, so that the columns before it keep their places
)


def write_records_csv(records: Iterable[RequestRecord], path: Path) -> Path:
    """One line per request (columns `CSV_COLUMNS`); `expert_rows` reads `id:rows id:rows`.

    Failed requests are kept, with their status, so that a spreadsheet sees the whole run.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(CSV_COLUMNS)
        for record in sorted(records, key=lambda record: record.index):
            writer.writerow(
                (
                    record.index,
                    f"{record.start_s:.6f}",
                    f"{record.end_s:.6f}",
                    f"{record.latency_ms:.3f}",
                    record.rows,
                    record.status,
                    record.hits,
                    record.misses,
                    "" if record.vram_bytes is None else record.vram_bytes,
                    " ".join(f"{key}:{value}" for key, value in sorted(record.expert_rows.items())),
                    "" if record.sent_s is None else f"{record.sent_s:.6f}",
                )
            )
    return path


def _record_dict(record: RequestRecord) -> dict[str, Any]:
    data = asdict(record)
    data["latency_ms"] = record.latency_ms
    data["expert_rows"] = {str(key): value for key, value in record.expert_rows.items()}
    data["condition_keys"] = list(record.condition_keys)
    return data


def _finite(value: float) -> float:
    # JSON has no NaN: an empty set of samples reads as 0 (with ok = 0 beside it).
    return value if math.isfinite(value) else 0.0


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _human_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
