"""benchmarks/serve_ab.py --code runs each commit's momlp (server and actors) from a worktree
of it, here on a small store, one trial each.

0f9847e speaks the actor channel's first frame format (magic MLW1) and this checkout the
second: were the actors of the old side to import this checkout's code, as they did before
the server was started in its worktree, every call of that side would fail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from script_support import ROOT, run_benchmark

pytestmark = [pytest.mark.ray, pytest.mark.integration]

OLD = "0f9847e"


def _worktrees() -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout


def test_each_side_of_a_code_ab_serves_with_its_own_commits_code(tmp_path: Path) -> None:
    before = _worktrees()
    lines = run_benchmark(
        "serve_ab.py", "--code", f"{OLD},HEAD", "--trials", "1", "--requests", "200",
        "--warmup", "20", "--experts", "16", "--widths", "8,64,64,4",
        "--experts-per-actor", "4", "--actors", "1", "--ray-num-cpus", "1",
        "--store", str(tmp_path / "store"),
    )  # fmt: skip
    assert sorted(line["value"] for line in lines) == sorted([OLD, "HEAD"])
    for line in lines:
        assert line["setting"] == "code"
        assert line["errors"] == 0 and line["rows_per_s"] > 0
    assert _worktrees() == before  # the temporary worktrees are gone


def test_a_commit_that_does_not_exist_is_named(tmp_path: Path) -> None:
    before = _worktrees()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_ab.py"), "--code", "HEAD,nosuchcommit",
         "--experts", "4", "--widths", "8,4", "--store", str(tmp_path / "store")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode != 0
    assert "no worktree of 'nosuchcommit'" in done.stderr
    assert not (tmp_path / "store").exists()  # refused before anything was built
    assert _worktrees() == before  # HEAD's worktree, made first, is gone too


def test_a_run_past_its_time_is_interrupted_and_leaves_no_server_behind(tmp_path: Path) -> None:
    """The suite's timeout interrupts a script rather than killing it: its servers are stopped
    and its stderr says where it was (a killed one left `momlp serve` and its Ray running)."""
    store = tmp_path / "store"
    with pytest.raises(pytest.fail.Exception) as failed:
        run_benchmark(
            "serve_ab.py", "--setting", "MOMLP_ACCESS_LOG", "--values", "1", "--trials", "1",
            "--requests", "200000", "--warmup", "20", "--experts", "16", "--widths", "8,64,64,4",
            "--experts-per-actor", "4", "--actors", "1", "--ray-num-cpus", "1",
            "--store", str(store), timeout_s=8.0,
        )  # fmt: skip
    message = str(failed.value)
    assert "serve_ab.py ran past 8 s" in message
    assert "KeyboardInterrupt" in message  # the script's own traceback: where it was
    left = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert not [line for line in left.stdout.splitlines() if str(store) in line]


def test_a_server_that_cannot_start_is_reported_at_once_with_its_reason(tmp_path: Path) -> None:
    """momlp serve refuses the value and exits: the A/B stops there, with the server's own
    error, instead of polling the port for four minutes."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_ab.py"), "--setting",
         "MOMLP_ACCESS_LOG", "--values", "notabool", "--trials", "1", "--experts", "4",
         "--widths", "8,4", "--experts-per-actor", "2", "--actors", "1",
         "--store", str(tmp_path / "store")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "before it was ready" in done.stderr and "the server exited with" in done.stderr
    assert "invalid settings: MOMLP_ACCESS_LOG" in done.stderr  # the server's log, printed
