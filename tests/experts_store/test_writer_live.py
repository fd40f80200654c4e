"""A publish reads the live manifest as `Store.open` does (experts_store/_live.py): one that
`Store.open` refuses is replaced, every file kept, and the warning says which store and why."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from experts_store_helpers import publish

from experts_store import MAX_MANIFEST_BYTES, Manifest, Store

pytestmark = pytest.mark.unit


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def count_as_text(root: Path) -> None:
    # Valid JSON and a valid manifest to a lax reader, which takes "3" for 3.
    path = root / "manifest.json"
    text = path.read_text()
    path.write_text(re.sub(r'"input_dim": (\d+)', r'"input_dim": "\1"', text, count=1))


def past_the_cap(root: Path) -> None:
    # Sparse: the file system stores the manifest's text, not the zeros after it.
    os.truncate(root / "manifest.json", MAX_MANIFEST_BYTES + 1)


def a_fifo(root: Path) -> None:
    # Nothing ever writes into it: a blocking open or read of it never returns.
    (root / "manifest.json").unlink()
    os.mkfifo(root / "manifest.json")


def a_link_out_of_the_store(root: Path) -> None:
    outside = root.parent / "elsewhere.json"
    (root / "manifest.json").rename(outside)
    (root / "manifest.json").symlink_to(outside)


@pytest.mark.timeout(60)  # the FIFO: a reader that blocks on it would wait for good
@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (count_as_text, 'input_dim: Input should be a valid integer, got "3"'),
        (past_the_cap, f"more than the {MAX_MANIFEST_BYTES} a manifest may"),
        (a_fifo, "cannot read manifest.json: not a regular file"),
        (a_link_out_of_the_store, "outside the store"),
    ],
    ids=["count-as-text", "past-the-cap", "fifo", "link-out-of-the-store"],
)
def test_a_publish_over_a_manifest_store_open_refuses_replaces_it_and_keeps_every_file(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    spoil: Callable[[Path], None],
    why: str,
) -> None:
    root = tmp_path / "store"
    first = publish(root, seed=1)
    spoil(root)

    with caplog.at_level(logging.WARNING, logger="experts_store"):
        second = publish(root, seed=2)

    assert Store.open(root).manifest.store_version == second.store_version
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"bad manifest in {root}: " in text
        and why in text
        and "this publish replaces it and keeps every file" in text
        for text in warnings
    ), warnings
    # Which files the refused manifest needed is unknown: none of them is retired.
    assert {e.file for e in first.experts} <= files_under(root)
    assert not (root / "retired.json").exists()


def test_publishes_over_a_good_store_warn_of_nothing_and_retire_what_no_manifest_needs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    first: Manifest = publish(root, seed=1)

    with caplog.at_level(logging.WARNING, logger="experts_store"):
        publish(root, seed=2)
        publish(root, seed=3)  # the first version's files: neither the new nor the previous

    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    retired = (root / "retired.json").read_text()
    assert all(e.file in retired for e in first.experts)
