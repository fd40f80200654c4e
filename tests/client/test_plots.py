"""The PNG plots of a report: which are written, and that they are PNG images."""

from __future__ import annotations

import pytest

from client import RequestRecord
from client._plots import PLOT_TITLES, write_plots
from client._report import build_report

pytestmark = pytest.mark.unit

ALWAYS = {
    "latency_percentiles.png",
    "latency_over_time.png",
    "throughput_over_time.png",
    "hit_rate_over_time.png",
    "vram_per_request.png",
    "device_bytes_over_time.png",
}


def make_report(*, rate: float | None = None, failed: int = 0):
    records = [
        RequestRecord(
            i,
            i * 0.3,
            i * 0.3 + 0.05,
            4,
            "503" if i < failed else "200",
            hits=i % 2,
            misses=1 - i % 2,
            vram_bytes=1000 + i,
            device_bytes={"a": 100 * i, "b": 50},
            expert_rows={i % 3: 4},
        )
        for i in range(12)
    ]
    return build_report(
        records,
        duration_s=4.0,
        dense_equivalent_bytes=10**6,
        max_expert_bytes=900,
        config={"rate": rate},
        model={},
        workload={},
    )


def test_closed_loop_without_errors_writes_the_six_plots(tmp_path):
    pytest.importorskip("matplotlib")
    report = make_report()
    paths = write_plots(report, tmp_path / "plots", vram_samples=[1000.0 + i for i in range(12)])
    assert {path.name for path in paths} == ALWAYS
    for path in paths:
        assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 1000


def test_open_loop_and_errors_add_their_plots(tmp_path):
    pytest.importorskip("matplotlib")
    report = make_report(rate=3.0, failed=2)
    paths = write_plots(report, tmp_path, vram_samples=[1000.0 + i for i in range(10)])
    assert {path.name for path in paths} == set(PLOT_TITLES)
    assert ALWAYS | {"offered_vs_achieved.png", "errors_by_status.png"} == set(PLOT_TITLES)


def test_the_errors_plot_writes_nothing_to_the_log(tmp_path, caplog):
    # `momlp loadtest` logs at INFO to stderr: status strings given to matplotlib as x values
    # ("503") made it log twice, on every run with errors, that they read as numbers.
    pytest.importorskip("matplotlib")
    report = make_report(failed=3)
    with caplog.at_level("INFO", logger="matplotlib"):
        paths = write_plots(report, tmp_path, vram_samples=[1000.0])
    assert "errors_by_status.png" in {path.name for path in paths}
    assert [r.getMessage() for r in caplog.records if r.name.startswith("matplotlib")] == []
