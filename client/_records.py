"""One load-test request as the generator saw it (`RequestRecord`), and requests.csv of them."""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CSV_COLUMNS", "RequestRecord", "record_dict", "write_records_csv"]


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


def record_dict(record: RequestRecord) -> dict[str, Any]:
    """The record as report.json's `records` holds it (with --save-requests)."""
    data = asdict(record)
    data["latency_ms"] = record.latency_ms
    data["expert_rows"] = {str(key): value for key, value in record.expert_rows.items()}
    data["condition_keys"] = list(record.condition_keys)
    return data
