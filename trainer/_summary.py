"""The report a build's summary line is made from: its own, not whatever the store has now."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["own_report"]


def own_report(out: Path, version: str) -> dict[str, Any] | None:
    """report.json of `version`, the one this build published into `out`; None (said on
    stderr) when another publish has replaced it since: its figures are then in the log,
    and the summary leaves them out rather than print the other build's."""
    from experts_store import read_report

    report = read_report(out, version)
    if report is None:
        print(
            f"momlp build: published version {version} into {out}, and another publish has"
            " replaced it since; its figures are in the log above, not in this summary",
            file=sys.stderr,
        )
    return report
