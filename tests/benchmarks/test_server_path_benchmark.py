"""benchmarks/server_path.py drives momlp's app in process with actors that answer at once
(here a small store, two trials, each in its own interpreter).

Checks what it prints and that the figures hang together, not how fast anything was. The
script itself refuses an answer that is not the instant actors' zeros routed as the store's
router routes, so a run that prints is a run of the serving path.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from script_support import ROOT, run_benchmark

pytestmark = [pytest.mark.integration]


def test_server_path_prints_each_trial_and_the_median(tmp_path: Path) -> None:
    lines = run_benchmark(
        "server_path.py", "--trials", "2", "--requests", "400", "--warmup", "80",
        "--experts", "16", "--widths", "8,64,64,4", "--experts-per-actor", "4",
        "--concurrency", "8", "--store", str(tmp_path / "store"),
    )  # fmt: skip
    trials = [line for line in lines if "trial" in line]
    assert [line["trial"] for line in trials] == [0, 1]
    for line in trials:
        assert line["momlp"] == str(ROOT)
        assert line["requests"] == 400
        # Closed loop: a batch holds at most one request per client, and the open-connection
        # rule closes most windows only when all eight are in.
        assert 1 <= line["requests_per_batch"] <= 8
        assert line["batches"] * line["requests_per_batch"] == pytest.approx(400)
        assert line["server_cpu_us_per_request"] > line["driver_floor_cpu_us_per_request"] > 0
        assert line["stub_actor_cpu_us_per_request"] > 0
    [summary] = [line for line in lines if "medians" in line]
    assert summary["medians"] == {
        "this checkout": statistics.median(t["server_cpu_us_per_request"] for t in trials)
    }
    assert "new_over_base" not in summary


def test_server_path_refuses_one_commit_twice() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "server_path.py"), "--code", "HEAD,HEAD"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "two different commits" in done.stderr
