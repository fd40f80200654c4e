"""benchmarks/loadtest_vs_locust.py runs `momlp loadtest` and real locust on one real `momlp
serve` with the same seeded requests: both answer every request, the rows are the same, and
the ratios it prints are those of the runs it printed.

Checks what it prints and that the figures hang together, not how fast anything was.
"""

from __future__ import annotations

import importlib.util

import pytest
from script_support import run_benchmark

pytestmark = [pytest.mark.ray, pytest.mark.integration]


def test_both_tools_send_the_same_requests_and_every_one_is_answered() -> None:
    # Not imported here: locust monkey-patches the standard library on import.
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust is not installed (dev extras)")
    lines = run_benchmark(
        "loadtest_vs_locust.py", "--quick", "--requests", "120", "--rounds", "1",
        "--concurrency", "4",
    )  # fmt: skip
    runs = {line["tool"]: line for line in lines if "tool" in line}
    assert set(runs) == {"momlp loadtest", "locust"}
    for run in runs.values():
        assert (run["round"], run["ok"], run["errors"]) == (0, 120, 0)
        assert 0 < run["p50_ms"] <= run["p99_ms"]
    # The load test's rows reached the experts the bodies locust replays route to.
    assert runs["momlp loadtest"]["same_rows_as_locust"] is True
    # locust's own summary of the run it made (its stats, not this script's timing).
    assert runs["locust"]["locust_summary"]["requests_per_s"] > 0
    [ratio] = [line for line in lines if line.get("figure") == "locust / momlp loadtest"]
    assert (ratio["requests"], ratio["rounds"], ratio["concurrency"]) == (120, 1, 4)
    assert ratio["ratio_requests_per_s"] == pytest.approx(
        runs["locust"]["requests_per_s"] / runs["momlp loadtest"]["requests_per_s"], rel=1e-2
    )
    # Each tool's start-up CPU subtracted is the median of its tiny runs, each of which ran.
    [cpu] = [line for line in lines if line.get("figure") == "client CPU per request (ms)"]
    assert cpu["tiny_runs"] == 3
    for tool in ("loadtest", "locust"):
        low, high = cpu[f"{tool}_startup_cpu_s_range"]
        assert 0 < low <= cpu[f"{tool}_startup_cpu_s"] <= high
