"""benchmarks/http_floor.py runs a real `momlp serve` and a bare uvicorn app under the same
driver and splits each one's CPU per request (here a small store, one round).

Checks what it prints and that the figures hang together, not how fast anything was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from script_support import run_benchmark

pytestmark = [pytest.mark.ray, pytest.mark.integration]


def test_http_floor_prints_both_servers_and_their_ratio(tmp_path: Path) -> None:
    lines = run_benchmark(
        "http_floor.py", "--quick", "--experts", "16", "--widths", "8,64,64,4",
        "--experts-per-actor", "4", "--actors", "1", "--ray-num-cpus", "1",
        "--store", str(tmp_path / "store"),
    )  # fmt: skip
    rounds = {line["system"]: line for line in lines if "round" in line}
    assert set(rounds) == {"momlp", "floor"}
    for line in rounds.values():
        assert (line["requests"], line["errors"]) == (600, 0)
        assert line["rows_per_s"] > 0 and 0 < line["p50_ms"] <= line["p99_ms"]
    # momlp's actors run in processes below the server; the floor has none.
    assert rounds["momlp"]["cpu_ms_per_request_descendants"] > 0
    assert rounds["floor"]["cpu_ms_per_request_descendants"] == 0
    [ratio] = [line for line in lines if line.get("stat", "").startswith("ratio")]
    medians = {line["system"]: line for line in lines if line.get("stat") == "median"}
    momlp = medians["momlp"]["cpu_ms_per_request_http_process"]
    floor = medians["floor"]["cpu_ms_per_request_http_process"]
    assert ratio["momlp_http_process_above_floor_ms"] == pytest.approx(momlp - floor)
    if floor > 0:
        assert ratio["http_process_cpu_ratio"] == pytest.approx(momlp / floor)
