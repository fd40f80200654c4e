"""Run a script of benchmarks/ as a user does and read the JSON lines it prints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

__all__ = ["run_benchmark"]

ROOT = Path(__file__).resolve().parents[2]

# After a timeout the script gets SIGINT and this long to stop its servers and print their
# logs (vs_ray_serve.served prints a server's log when interrupted) before it is killed. More
# than the script's own bound on stopping a server (SIGTERM, SIGKILL past 90 s, then up to 30 s
# to reap): killed sooner, the script left a server that had not stopped yet running.
_STOP_S = 150.0


def run_benchmark(script: str, *args: str, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """`python benchmarks/<script> <args>` from the repository root with one BLAS thread;
    fails the test with the script's stderr when it exits non-zero or runs past `timeout_s`.

    A script past its time is interrupted (SIGINT), not killed: its `finally` blocks stop the
    servers it started (a killed script would leave them and their Ray behind) and its
    stderr then says where it was.
    """
    # A shell starts a background job with SIGINT ignored, and a child inherits that (a
    # handler it does not): the script could not be interrupted, and was killed with its
    # servers left running. With a handler here for the moment of the start, it is not.
    interruptible = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if interruptible else None
    try:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            cwd=ROOT,
        )
    finally:
        if interruptible:
            signal.signal(signal.SIGINT, previous)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            stdout, stderr = process.communicate(timeout=_STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(
            f"{script} ran past {timeout_s:.0f} s; its output:\n{stdout[-2000:]}\n"
            f"its stderr:\n{stderr[-6000:]}"
        )
    assert process.returncode == 0, stderr[-2000:]
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
