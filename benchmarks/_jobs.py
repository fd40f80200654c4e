"""Rows of a paper script's Ray jobs as they finish: kept, saved and reported one by one."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["gather_rows"]


def gather_rows(
    pending: list[Any], *, raw: Path | None, describe: Callable[[dict[str, Any]], str]
) -> list[dict[str, Any]]:
    """Wait for every job in `pending` (Ray object refs of dict rows), in the order they
    finish. Each row goes to `raw` (JSON lines) at once, so that a run cut short keeps what
    it trained, and `[done/total] describe(row)` to stderr."""
    import ray

    rows: list[dict[str, Any]] = []
    total = len(pending)
    out = raw.open("w") if raw else None
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            row = ray.get(done[0])
            rows.append(row)
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
            print(f"[{len(rows)}/{total}] {describe(row)}", file=sys.stderr, flush=True)
    finally:
        if out is not None:
            out.close()
    return rows
