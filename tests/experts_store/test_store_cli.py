"""`momlp store info|verify` (experts_store/_cli.py), through the real `momlp` root parser."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from experts_store import Store
from server._cli import main

pytestmark = pytest.mark.unit


def test_info_prints_a_summary_and_per_expert_rows(
    store_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["store", "info", str(store_root)]) == 0
    out = capsys.readouterr().out
    manifest = Store.open(store_root).manifest
    assert manifest.store_version in out
    assert "K=3" in out and "ν=2" in out and "routing=tree" in out and "3 -> 2" in out
    for entry in manifest.experts:
        assert f"{entry.bytes}" in out


def test_info_json(store_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "info", str(store_root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    manifest = Store.open(store_root).manifest
    assert data["num_experts"] == 3
    assert data["total_expert_bytes"] == manifest.total_expert_bytes
    assert [e["id"] for e in data["experts"]] == [0, 1, 2]


def test_verify_passes_on_an_intact_store(
    store_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["store", "verify", str(store_root)]) == 0
    assert "ok" in capsys.readouterr().out


def test_verify_names_the_corrupted_expert(
    store_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = Store.open(store_root).expert_path(2)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert main(["store", "verify", str(store_root)]) != 0
    out = capsys.readouterr().out
    assert "FAIL expert 2" in out
    assert "failing experts: 2" in out


def test_verify_shows_its_progress_in_bytes_unless_told_not_to(
    store_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    total = tqdm.format_sizeof(Store.open(store_root).manifest.total_expert_bytes, divisor=1024)
    assert main(["store", "verify", str(store_root)]) == 0
    err = capsys.readouterr().err
    assert f"verify: 100%|██████████| {total}/{total}" in err
    assert main(["store", "verify", "--no-progress", str(store_root)]) == 0
    assert capsys.readouterr().err == ""


def test_verify_reports_every_experts_bytes_failed_or_not(store_root: Path) -> None:
    store = Store.open(store_root)
    path = store.expert_path(1)
    path.write_bytes(path.read_bytes()[:-5])
    seen: list[int] = []
    problems = store.verify(progress=seen.append)
    assert [p.expert_id for p in problems] == [1]
    assert seen == [entry.bytes for entry in store.manifest.experts]


def test_missing_store_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "verify", str(tmp_path)]) == 1
    assert "no store" in capsys.readouterr().err


def test_console_script_verify(store_root: Path) -> None:
    script = Path(sys.executable).with_name("momlp")
    command = [str(script)] if script.exists() else [shutil.which("momlp") or "momlp"]
    Store.open(store_root).expert_path(0).unlink()
    result = subprocess.run(
        [*command, "store", "verify", str(store_root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "FAIL expert 0" in result.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly(store_root: Path) -> None:
    """`momlp store info STORE | head -1`: SIGPIPE's exit status, and no traceback."""
    script = Path(sys.executable).with_name("momlp")
    command = [str(script)] if script.exists() else [shutil.which("momlp") or "momlp"]
    with subprocess.Popen(
        [*command, "store", "info", str(store_root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # before the command has imported anything, let alone printed
        stderr = process.stderr.read().decode()
        code = process.wait(timeout=120)
    assert code == 141
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
