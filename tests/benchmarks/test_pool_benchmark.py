"""benchmarks/pool.py still runs against the serving code it measures.

Its batching part built a `Batcher` with the round-1 signature and failed from the v2
re-layout on, unnoticed because nothing ran it. This runs the script as a user does (on the
in-process fake pool, quick) and checks what it prints, not how fast anything was.
"""

from __future__ import annotations

import pytest
from script_support import run_benchmark

pytestmark = pytest.mark.unit


def test_pool_benchmark_batches_requests_and_times_misses() -> None:
    lines = run_benchmark(
        "pool.py", "--quick", "--pool", "fake", "--only", "batching,miss_latency"
    )
    batching = [line for line in lines if line["bench"] == "pool.batching"]
    misses = [line for line in lines if line["bench"] == "pool.miss_latency"]
    assert len(batching) == 1 and len(misses) == 1
    # 32 clients of one-row requests: the batcher merges them, the baseline does not.
    assert batching[0]["mean_batch_rows"] > 4
    assert batching[0]["rows_per_s_batched"] > 0
    assert batching[0]["rows_per_s_one_request_per_batch"] > 0
    assert misses[0]["miss_ms"] > 0 and misses[0]["raw_load_expert_ms"] > 0
