"""Figures of a load-test report from hand-made records, checked against numpy."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client import RequestRecord
from client._report import CSV_COLUMNS, build_report, percentile, write_records_csv

pytestmark = pytest.mark.unit


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    q=st.floats(0, 100),
)
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-9, abs=1e-6)


def record(index, start, end, status="200", **kwargs):
    return RequestRecord(index, start, end, kwargs.pop("rows", 2), status, **kwargs)


def test_build_report_counts_and_buckets():
    records = [
        record(
            0,
            0.0,
            0.1,
            hits=1,
            misses=1,
            vram_bytes=100,
            device_bytes={"a": 10},
            expert_rows={3: 2},
        ),
        record(
            1,
            0.2,
            0.5,
            hits=2,
            misses=0,
            vram_bytes=300,
            device_bytes={"a": 20},
            expert_rows={3: 1, 4: 1},
        ),
        record(2, 0.6, 1.2, status="429"),
        record(
            3, 1.0, 1.5, hits=0, misses=1, vram_bytes=200, device_bytes={"b": 5}, expert_rows={5: 2}
        ),
        record(4, 1.1, 1.6, status="timeout"),
    ]
    report = build_report(
        records,
        duration_s=2.0,
        dense_equivalent_bytes=1000,
        max_expert_bytes=90,
        config={},
        model={"num_experts": 6},
        workload={},
        save_requests=True,
    )
    assert (report.requests, report.ok, report.errors, report.rows) == (5, 3, 2, 6)
    assert report.errors_by_status == {"429": 1, "timeout": 1}
    assert (report.hits, report.misses, report.loads) == (3, 2, 2)
    assert report.hit_rate == pytest.approx(0.6)
    assert report.requests_per_s == pytest.approx(1.5) and report.rows_per_s == pytest.approx(3)
    ok_latencies = [100.0, 300.0, 500.0]
    assert report.latency_ms["p50"] == pytest.approx(np.percentile(ok_latencies, 50))
    assert report.latency_ms["max"] == pytest.approx(500.0)
    assert report.vram_bytes["p99"] == pytest.approx(np.percentile([100, 300, 200], 99))
    assert report.vram_ratio == pytest.approx(np.percentile([100, 300, 200], 99) / 1000)
    assert report.expert_rows == {"3": 3, "4": 1, "5": 2}
    first, second = report.time_series
    assert (first["t"], first["requests"], first["errors"], first["hits"]) == (0, 2, 0, 3)
    assert first["device_bytes"] == {"a": 20}
    assert (second["t"], second["requests"], second["errors"]) == (1, 1, 2)
    assert first["requests_per_s"] == 2.0
    # The run ended at 2.0 s: the second bucket covers a full second.
    assert second["rows_per_s"] == pytest.approx(2.0)
    assert second["hit_rate"] == 0.0 and second["device_bytes"] == {"b": 5}
    assert len(report.records) == 5 and report.records[0]["latency_ms"] == pytest.approx(100)
    assert "errors by status: 429: 1, timeout: 1" in report.summary()


def test_a_conditions_run_counts_distinct_conditions_not_experts():
    # A --conditions run against a hyper store: every row's θ has key-only stats (expert -1).
    keys = [("a", "b"), ("b", "c"), ("z",)]
    records = [
        record(i, 0.1 * i, 0.1 * i + 0.05, vram_bytes=500, expert_rows={-1: 2},
               condition_keys=k)
        for i, k in enumerate(keys)
    ]
    records[2] = record(2, 0.2, 0.3, status="503", condition_keys=("z",))  # failed: not served
    hyper = {"generator_bytes": 2048, "theta_bytes": 512}
    report = build_report(
        records, duration_s=1.0, dense_equivalent_bytes=0, max_expert_bytes=0, config={},
        model={"num_experts": 0, "kind": "hyper", "hyper": hyper},
        workload={"conditions": 10, "distinct_drawn": 4},
    )
    assert report.conditions_served == 3
    summary = report.summary()
    assert "conditions served 3 distinct θ (of 4 drawn, from a table of 10)" in summary
    assert "the pinned hypernetwork 2.00 KiB + θ 512 B per condition" in summary
    assert "experts served" not in summary and "dense model" not in summary
    # The same records in an ordinary run (no condition table) keep the experts' lines.
    plain = build_report(
        records, duration_s=1.0, dense_equivalent_bytes=0, max_expert_bytes=0, config={},
        model={"num_experts": 0}, workload={},
    )
    assert "experts served 1 of 0" in plain.summary() and "dense model" in plain.summary()


def test_empty_run_gives_zeros_not_nan():
    report = build_report(
        [record(0, 0.0, 0.1, status="503")],
        duration_s=0.1,
        dense_equivalent_bytes=0,
        max_expert_bytes=0,
        config={},
        model={},
        workload={},
    )
    assert report.latency_ms == {
        "p50": 0.0,
        "p90": 0.0,
        "p95": 0.0,
        "p99": 0.0,
        "p99.9": 0.0,
        "max": 0.0,
        "mean": 0.0,
    }
    assert report.hit_rate is None and report.vram_ratio is None
    assert "hit rate n/a" in report.summary()


def test_a_second_with_arrivals_but_no_answers_keeps_its_bucket():
    # Three requests arrive in second 0; the server answers nothing until second 2.
    records = [record(i, 0.1 * i, 2.5, vram_bytes=1) for i in range(3)] + [
        record(3, 1.2, 2.6, status="503")
    ]
    report = build_report(
        records,
        duration_s=3.0,
        dense_equivalent_bytes=10,
        max_expert_bytes=1,
        config={},
        model={},
        workload={},
    )
    by_second = {bucket["t"]: bucket for bucket in report.time_series}
    assert sorted(by_second) == [0, 1, 2]
    assert [by_second[t]["offered"] for t in (0, 1, 2)] == [3, 1, 0]
    assert [by_second[t]["requests"] for t in (0, 1, 2)] == [0, 0, 3]
    assert by_second[2]["errors"] == 1 and by_second[1]["requests_per_s"] == 0.0


def test_records_csv_has_one_line_per_request(tmp_path):
    records = [
        record(1, 0.5, 0.75, hits=1, misses=0, vram_bytes=300, expert_rows={4: 1, 2: 1},
               sent_s=0.625),
        record(0, 0.0, 0.125, status="client_busy"),
    ]
    path = write_records_csv(records, tmp_path / "requests.csv")
    with path.open(newline="") as stream:
        lines = list(csv.DictReader(stream))
    assert list(lines[0]) == list(CSV_COLUMNS)
    assert [line["index"] for line in lines] == ["0", "1"]
    assert lines[0]["status"] == "client_busy" and lines[0]["vram_bytes"] == ""
    # When each left the generator (an open loop's own delay is sent_s - start_s); never.
    assert float(lines[1]["sent_s"]) == 0.625 and lines[0]["sent_s"] == ""
    assert float(lines[0]["latency_ms"]) == pytest.approx(125.0)
    assert lines[1]["expert_rows"] == "2:1 4:1" and lines[1]["vram_bytes"] == "300"
