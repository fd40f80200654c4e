"""Scripts the GPU session runs (benchmarks/gpu_session.sh) still run here, on CPU.

Device time is scarce: a script that fails on its first line there wastes a machine's start.
These check what the scripts print and decide, not how fast anything was.
"""

from __future__ import annotations

import pytest
from script_support import run_benchmark

pytestmark = pytest.mark.unit


def test_pipelined_load_reports_every_thread_count_and_delivers_the_bytes() -> None:
    # The script itself fails if the buffer it filled differs from the file.
    (line,) = run_benchmark(
        "pipelined_load.py", "--quick", "--device", "cpu", "--threads", "1,2"
    )
    assert line["device"] == "cpu" and line["file_mib"] == 16
    for figure in ("read_ms", "pipelined_ms", "ratio"):
        assert set(line[figure]) == {"1", "2"} and all(v > 0 for v in line[figure].values())
    assert line["copy_ms"] > 0


def test_table4_stops_starting_seeds_once_its_time_budget_would_be_passed() -> None:
    (line,) = run_benchmark(
        "paper_table4.py", "--quick", "--executor", "local", "--tasks", "holder1d",
        "--seeds", "3", "--time-budget-s", "0.001",
    )  # fmt: skip
    assert (line["seeds"], line["seeds_planned"]) == (1, 3)
    (later,) = run_benchmark(
        "paper_table4.py", "--quick", "--executor", "local", "--tasks", "holder1d",
        "--seeds", "1", "--first-seed", "2",
    )  # fmt: skip
    assert (later["seeds"], later["first_seed"]) == (1, 2)
    # Another seed, another split and initialisation: not the first run's figure.
    assert later["mixture_mse_mean"] != line["mixture_mse_mean"]


def test_table4_ablation_flags_train_the_mixture_alone_and_record_its_cells() -> None:
    (line,) = run_benchmark(
        "paper_table4.py", "--quick", "--executor", "local", "--tasks", "ackley2d",
        "--no-baseline", "--prototype-epochs", "3", "--select-epoch", "best-validation",
    )  # fmt: skip
    assert line["prototype_epochs"] == 3 and line["select_epoch"] == "best-validation"
    assert line["baseline_mse_mean"] is None and line["mixture_beats_baseline"] is None
    (seed,) = line["per_seed"]
    assert seed["baseline"] is None and seed["mixture"] == line["mixture_mse_mean"]
    # Every training row of the quick 16 x 16 grid (51 of its 256 points held out) lands in
    # exactly one cell.
    assert len(seed["train_samples"]) == 4 and sum(seed["train_samples"]) == 256 - 51
    assert len(seed["train_metric"]) == 4
    # A tenth of each cell's training rows held out to choose its epoch (quick: 8 epochs).
    assert seed["validation_samples"] == [round(n * 0.1) for n in seed["train_samples"]]
    assert all(0 <= e <= 8 for e in seed["best_epoch"])
    # Each cell's own test MSE, weighted by its test rows, adds up to the mixture's.
    counts, cells = seed["test_samples"], seed["test_metric"]
    assert sum(counts) == 51 and len(cells) == 4
    assert [c is None for c in cells] == [n == 0 for n in counts]
    weighted = sum(n * m for n, m in zip(counts, cells, strict=True) if n) / 51
    assert weighted == pytest.approx(seed["mixture"], rel=1e-6)


def test_row_block_ab_times_each_block_and_checks_the_default_is_batch_invariant() -> None:
    lines = run_benchmark("cuda_row_block.py", "--quick", "--device", "cpu", "--blocks", "4,16")
    assert [(line["row_block"], line["default"]) for line in lines] == [(4, True), (16, False)]
    for line in lines:
        assert set(line["us"]) == {"1", "3", "16", "40", "64"}
        assert all(v > 0 for v in line["us"].values())
    # 4-row blocks are this CPU build's batch-invariant size (tests/server/test_batch_alignment).
    assert lines[0]["invariant"] is True

