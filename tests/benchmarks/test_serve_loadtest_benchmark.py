"""benchmarks/serve_loadtest.py runs a real `momlp serve` under `momlp loadtest` and prints
VRAM per request beside the dense model (here on CPU, the GPU session's step in small).

Checks what it prints and that the figures hang together, not how fast anything was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from script_support import run_benchmark

pytestmark = [pytest.mark.ray, pytest.mark.integration]


def test_serve_loadtest_prints_one_expert_per_request_beside_the_dense_model(
    tmp_path: Path,
) -> None:
    [line] = run_benchmark(
        "serve_loadtest.py", "--device", "cpu", "--quick", "--experts", "16",
        "--widths", "8,64,64,4", "--requests", "60", "--actors", "1",
        "--store", str(tmp_path / "store"),
    )  # fmt: skip
    assert (line["requests"], line["ok"], line["errors"]) == (60, 60, 0)
    assert line["rows_per_s"] > 0 and 0 < line["p50_ms"] <= line["p99_ms"]
    assert 0.0 <= line["hit_rate"] <= 1.0
    # top_k 1: a request holds one expert and its rows' activations, never two experts.
    expert = line["max_expert_bytes"]
    assert expert <= line["vram_bytes_p50"] <= line["vram_bytes_p99"] <= line["vram_bytes_max"]
    assert line["vram_bytes_max"] < 2 * expert
    # The dense model in vram_bytes' measure: 16 experts' weights as an actor holds them.
    assert line["dense_equivalent_bytes"] == 16 * line["expert_bytes"]
    assert line["vram_p99_over_dense"] == pytest.approx(
        line["vram_bytes_p99"] / line["dense_equivalent_bytes"]
    )
    assert line["budget_bytes_per_actor"] == 2 * line["expert_bytes"]  # 10 % of 16, rounded
