"""The load-test report: `LoadTestReport` (report.json's content) built from the records, and
the terminal summary.

The records and requests.csv live in `_records`, the figures computed from them in `_figures`;
their names are re-exported here, where callers have always imported them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._figures import (
    LATENCY_PERCENTILES,
    finite,
    latency_summary,
    percentile,
    rate,
    ratio,
    time_series,
)
from ._records import CSV_COLUMNS, RequestRecord, record_dict, write_records_csv

__all__ = [
    "CSV_COLUMNS",
    "LATENCY_PERCENTILES",
    "LoadTestReport",
    "RequestRecord",
    "build_report",
    "percentile",
    "write_records_csv",
]


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
    # --max-failed-fraction F: {"failed_fraction", "max_failed_fraction", "passed"}; the run
    # passes when no more than F of its requests failed (`_failure_check`). None without F.
    failure_check: dict[str, Any] | None = None
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
    max_failed_fraction: float | None = None,
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
        requests_per_s=rate(len(ok), duration_s),
        rows_per_s=rate(rows, duration_s),
        latency_ms=latency_summary(latencies),
        errors_by_status=dict(sorted(errors.items())),
        hits=hits,
        misses=misses,
        hit_rate=ratio(hits, hits + misses),
        loads=misses,
        vram_bytes={
            "p50": finite(percentile(vram, 50)),
            "p99": finite(p99_vram),
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
        records=[record_dict(record) for record in records] if save_requests else None,
        experts_per_row=sum(record.kept for record in ok) / rows if rows else None,
        conditions_served=len(conditions) if conditions else None,
        accuracy=accuracy,
        server_counts=server_counts,
        failure_check=_failure_check(len(records), len(records) - len(ok), max_failed_fraction),
    )


def _failure_check(
    requests: int, failed: int, max_failed_fraction: float | None
) -> dict[str, Any] | None:
    """The run's verdict against `max_failed_fraction` (None without one): it passes when the
    failed fraction is at most the limit, so 0 fails on the first failure and 1 never. A run
    that sent nothing has no fraction, and does not pass."""
    if max_failed_fraction is None:
        return None
    fraction = failed / requests if requests else None
    return {
        "failed_fraction": fraction,
        "max_failed_fraction": max_failed_fraction,
        "passed": fraction is not None and fraction <= max_failed_fraction,
    }


def _human_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
