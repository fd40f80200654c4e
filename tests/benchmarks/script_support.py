"""Run a script of benchmarks/ as a user does and read the JSON lines it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_benchmark"]

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """`python benchmarks/<script> <args>` from the repository root with one BLAS thread;
    fails the test with the script's stderr when it exits non-zero."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
