"""benchmarks/grouped_forward.py computes the same function three ways and prints each timing.

Checks what it prints and that the grouped forwards are the same function as the actor's
separate ones, not which is faster.
"""

from __future__ import annotations

import pytest
import torch
from script_support import run_benchmark

pytestmark = pytest.mark.unit


def test_grouped_forward_prints_three_ways_of_the_same_function() -> None:
    lines = run_benchmark("grouped_forward.py", "--quick", "--pool", "12")
    assert [(line["widths"], line["groups"], line["rows_per_group"]) for line in lines] == [
        (widths, groups, rows)
        for widths in ([16, 256, 512, 8], [32, 512, 512, 8])
        for groups, rows in ((4, 1), (12, 1), (12, 3))
    ]
    for line in lines:
        assert line["device"] == "cpu" and line["row_block"] == 4
        assert line["unsupported"] is None
        # float32 sums in another order: equal to rounding, on outputs of order 1-10.
        assert line["max_abs_diff"] < 1e-4
        us = line["us_per_call"]
        assert set(us) == {"separate", "grouped_slab", "grouped_stack"}
        assert all(value > 0 for value in us.values())
        assert line["vs_separate"]["separate"] == 1.0
        assert line["vs_separate"]["grouped_slab"] == pytest.approx(
            us["grouped_slab"] / us["separate"], abs=0.02
        )


def test_without_a_gpu_the_cuda_run_says_it_is_unmeasured() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the run measures it")
    lines = run_benchmark("grouped_forward.py", "--quick", "--device", "cuda")
    assert lines == [{"benchmark": "grouped_forward", "device": "cuda", "skipped": True,
                      "reason": "no CUDA device: unmeasured"}]
