"""benchmarks/actor_call.py runs against the actor it measures and prints every figure.

Run as a user runs it (its own Ray, a fresh store, few calls); checks what it prints and
that the figures hang together, not how fast anything was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from script_support import run_benchmark

pytestmark = pytest.mark.ray


def test_actor_call_benchmark_prints_the_work_the_bare_call_each_setting_and_the_channel(
    tmp_path: Path,
) -> None:
    lines = run_benchmark(
        "actor_call.py", "--quick", "--calls", "40", "--widths", "8,32,4",
        "--store", str(tmp_path / "store"),
    )  # fmt: skip
    where = [line["where"] for line in lines]
    assert where == ["in_process"] + ["ray_echo"] * 3 + ["ray"] * 4 + ["channel"] * 2
    settings = {(line["max_concurrency"], line["inflight"]) for line in lines[4:8]}
    assert settings == {(1, 1), (1, 4), (4, 1), (4, 4)}
    assert [line["inflight"] for line in lines[8:]] == [1, 4]
    for line in lines[1:]:
        assert line["calls_per_s"] > 0 and line["caller_cpu_ms_per_call"] >= 0
    for line in lines[4:]:
        # The figure it prints is the difference it names.
        expected = (line["actor_cpu_ms_per_call"] - line["work_cpu_ms_per_call"]
                    + line["caller_cpu_ms_per_call"])
        name = "call" if line["where"] == "channel" else "ray"
        assert line[f"{name}_overhead_cpu_ms_per_call"] == pytest.approx(expected)
