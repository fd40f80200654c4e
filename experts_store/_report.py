"""report.json: the training and evaluation figures a publish writes beside the manifest,
as strict JSON (a diverged run's NaN or infinity written as null)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["REPORT_NAME", "finite", "report_text"]

REPORT_NAME = "report.json"


def report_text(report: Mapping[str, Any]) -> str:
    """The report as report.json holds it; ValueError for a NaN or infinity left in it."""
    return json.dumps(report, indent=2, sort_keys=True, default=str, allow_nan=False)


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float inside it replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
