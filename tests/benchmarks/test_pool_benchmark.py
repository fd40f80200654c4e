"""benchmarks/pool.py still runs against the serving code it measures.

Its batching part built a `Batcher` with the round-1 signature and failed from the v2
re-layout on, unnoticed because nothing ran it. This runs the script as a user does (on the
in-process fake pool, quick) and checks what it prints, not how fast anything was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_pool_benchmark_batches_requests_and_times_misses() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "pool.py"),
            "--quick",
            "--pool",
            "fake",
            "--only",
            "batching,miss_latency",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    batching = [line for line in lines if line["bench"] == "pool.batching"]
    misses = [line for line in lines if line["bench"] == "pool.miss_latency"]
    assert len(batching) == 1 and len(misses) == 1
    # 32 clients of one-row requests: the batcher merges them, the baseline does not.
    assert batching[0]["mean_batch_rows"] > 4
    assert batching[0]["rows_per_s_batched"] > 0
    assert batching[0]["rows_per_s_one_request_per_batch"] > 0
    assert misses[0]["miss_ms"] > 0 and misses[0]["raw_load_expert_ms"] > 0
