"""The switch a publish makes: the staged report and manifest written durably, the staged
files renamed to their places in the store, and manifest.json replaced last with one
``os.replace``, so a crash at any point leaves either the previous store or the new one
readable, and a failed rename takes back what it had moved in."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from experts_store._exceptions import StoreWriteError
from experts_store._live import MANIFEST_NAME
from experts_store._report import REPORT_NAME

__all__ = ["fsync_dir", "switch_in", "write_durably"]


def fsync_dir(path: Path) -> None:
    """Make the entries of the folder `path` (files renamed in or out) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write `text` to `path` and fsync it before returning."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def switch_in(
    root: Path,
    staging: Path,
    *,
    manifest: str,
    report: str | None,
    moves: Sequence[tuple[Path, Path]],
    live: str | None,
) -> Path | None:
    """Make the files staged in `staging` the store at `root`: `moves` are (staged, in the
    store) pairs, `manifest` and `report` the texts of manifest.json and report.json.
    Returns the staged report, for the caller to move in once the store is live.

    The report and the manifest are written first, so a full disk stops the publish before
    anything is in the store; past that only renames are left, and a failed one takes back
    what was moved in. StoreWriteError (naming the file and `live`, the version that stays
    live) when one fails."""
    staged_manifest = staging / MANIFEST_NAME
    added: list[Path] = []  # files this publish put where none was (content addressed)
    target = staging / REPORT_NAME  # the file being written, for the error
    try:
        staged_report = None
        if report is not None:
            staged_report = target
            write_durably(staged_report, report)
        target = staged_manifest
        write_durably(staged_manifest, manifest)
        target = root / "experts"
        target.mkdir(exist_ok=True)
        for source, target in moves:
            new = not target.exists()
            os.replace(source, target)
            if new:
                added.append(target)
        fsync_dir(root / "experts")  # the files, before the manifest that names them
        target = root / MANIFEST_NAME
        os.replace(staged_manifest, target)
    except OSError as exc:
        for path in added:
            path.unlink(missing_ok=True)
        raise StoreWriteError.of(exc, target, live) from exc
    return staged_report
