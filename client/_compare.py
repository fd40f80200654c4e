"""Several `--gate`s compared: one load test per gate, then accuracy against VRAM per request.

`momlp loadtest --gate A --gate B --eval rows.npz --report DIR` writes each run's report into
DIR/gate-1, DIR/gate-2, … and, in DIR, gates.json (one line of figures per gate) and
gates.png (the --eval metric against device memory per request, one marker per gate).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._plots import byte_unit

if TYPE_CHECKING:
    from ._report import LoadTestReport

__all__ = ["COMPARE_JSON", "COMPARE_PLOT", "comparison_axes", "gate_rows", "write_comparison"]

COMPARE_JSON = "gates.json"
COMPARE_PLOT = "gates.png"


def gate_rows(
    gates: list[dict[str, Any] | None], reports: list[LoadTestReport]
) -> list[dict[str, Any]]:
    """One dict of figures per gate, in the order given."""
    rows = []
    for number, (gate, report) in enumerate(zip(gates, reports, strict=True), start=1):
        accuracy = report.accuracy or {}
        rows.append(
            {
                "run": f"gate-{number}",
                "gate": gate,
                "metric": accuracy.get("metric"),
                "value": accuracy.get("value"),
                "experts_per_row": report.experts_per_row,
                "vram_bytes_p50": report.vram_bytes["p50"],
                "vram_bytes_p99": report.vram_bytes["p99"],
                "latency_ms_p50": report.latency_ms["p50"],
                "ok": report.ok,
                "errors": report.errors,
            }
        )
    return rows


def comparison_axes(metric: str, largest_bytes: float) -> tuple[dict[str, str], float]:
    """gates.png's axis labels and title for `metric`, and the x axis's bytes per unit."""
    unit, scale = byte_unit(largest_bytes)
    name = "MSE" if metric == "mse" else "accuracy"
    labels = {
        "xlabel": f"device memory per request p50 ({unit})",
        "ylabel": f"test {name}",
        "title": f"Test {name} against device memory per request, one marker per gate",
    }
    return labels, scale


def write_comparison(
    gates: list[dict[str, Any] | None],
    reports: list[LoadTestReport],
    directory: Path,
    *,
    plot: bool = True,
) -> list[Path]:
    """gates.json, and gates.png where matplotlib is installed and --eval gave a metric."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = gate_rows(gates, reports)
    written = [directory / COMPARE_JSON]
    written[0].write_text(json.dumps(rows, indent=2, allow_nan=False) + "\n")
    scored = [row for row in rows if row["value"] is not None]
    if not plot or not scored:
        return written
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return written
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    labels, scale = comparison_axes(
        scored[0]["metric"], max(row["vram_bytes_p50"] for row in scored)
    )
    seen: dict[tuple[float, float], int] = {}
    for row in scored:
        where = (row["vram_bytes_p50"] / scale, row["value"])
        axes.scatter(*where, s=50)
        label = json.dumps(row["gate"]) if row["gate"] else "store default"
        # Gates that land on the same point get their labels stacked, not overprinted.
        stacked = seen[where] = seen.get(where, -1) + 1
        axes.annotate(label, where, fontsize=7, xytext=(4, 4 - 10 * stacked),
                      textcoords="offset points")
    axes.margins(x=0.4, y=0.15)
    axes.set(**labels)
    axes.grid(alpha=0.3)
    path = directory / COMPARE_PLOT
    figure.savefig(path, dpi=100)
    written.append(path)
    return written
