"""The five PNG plots of a report."""

from __future__ import annotations

import pytest

from client import RequestRecord
from client._plots import write_plots
from client._report import build_report

pytestmark = pytest.mark.unit


def test_write_plots_writes_five_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    records = [
        RequestRecord(
            i,
            i * 0.3,
            i * 0.3 + 0.05,
            4,
            "200",
            hits=i % 2,
            misses=1 - i % 2,
            vram_bytes=1000 + i,
            device_bytes={"a": 100 * i, "b": 50},
            expert_rows={i % 3: 4},
        )
        for i in range(12)
    ]
    report = build_report(
        records,
        duration_s=4.0,
        dense_equivalent_bytes=10**6,
        max_expert_bytes=900,
        config={},
        model={},
        workload={},
    )
    paths = write_plots(report, tmp_path / "plots", vram_samples=[1000.0 + i for i in range(12)])
    assert len(paths) == 5
    for path in paths:
        assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 1000
