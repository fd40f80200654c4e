"""How a benchmark names a file it wrote: relative to the checkout when the file lies inside
it (as RESULTS.md cites them), else absolute (`--plots /tmp/x` is fine too)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["shown"]

_ROOT = Path(__file__).resolve().parent.parent


def shown(path: Path) -> str:
    resolved = path.resolve()
    return str(resolved.relative_to(_ROOT) if resolved.is_relative_to(_ROOT) else resolved)
