"""PNG plots of a load-test report; matplotlib is optional (the `plots` extra)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._report import LoadTestReport

__all__ = ["matplotlib_available", "write_plots"]

logger = logging.getLogger(__name__)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(
    report: LoadTestReport, directory: Path, *, vram_samples: list[float]
) -> list[Path]:
    """Write the five plots into `directory`; returns their paths ([] without matplotlib)."""
    try:
        # Figure without pyplot: no global state, no GUI backend, safe in threads and servers.
        from matplotlib.figure import Figure
    except ImportError:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    series = report.time_series
    seconds = [bucket["t"] for bucket in series]
    written = []

    def save(figure: Any, name: str) -> None:
        path = directory / name
        figure.savefig(path, dpi=100)
        written.append(path)

    figure = Figure(figsize=(8, 4), layout="constrained")
    axes = figure.add_subplot()
    for key in ("p50", "p90", "p99"):
        axes.plot(seconds, [bucket["latency_ms"][key] for bucket in series], label=key)
    axes.set(xlabel="time (s)", ylabel="latency (ms)", title="Latency percentiles over time")
    axes.legend()
    save(figure, "latency_over_time.png")

    figure = Figure(figsize=(8, 4), layout="constrained")
    axes = figure.add_subplot()
    (requests_line,) = axes.plot(
        seconds, [bucket["requests_per_s"] for bucket in series], label="requests/s"
    )
    axes.set(xlabel="time (s)", ylabel="requests/s", title="Throughput over time")
    rows_axes = axes.twinx()
    (rows_line,) = rows_axes.plot(
        seconds,
        [bucket["rows_per_s"] for bucket in series],
        color="tab:orange",
        linestyle="--",
        label="rows/s",
    )
    rows_axes.set_ylabel("rows/s")
    axes.legend(handles=[requests_line, rows_line])
    save(figure, "throughput_over_time.png")

    figure = Figure(figsize=(8, 4), layout="constrained")
    axes = figure.add_subplot()
    axes.hist([value / 2**20 for value in vram_samples], bins=40)
    if report.dense_equivalent_bytes:
        axes.set_title(
            f"Device memory per request (dense model: {report.dense_equivalent_bytes / 2**20:.1f}"
            " MiB)"
        )
    axes.set(xlabel="vram_bytes per request (MiB)", ylabel="requests")
    save(figure, "vram_per_request.png")

    figure = Figure(figsize=(8, 4), layout="constrained")
    axes = figure.add_subplot()
    actors = sorted({actor for bucket in series for actor in bucket["device_bytes"]})
    for actor in actors:
        points = [
            (bucket["t"], bucket["device_bytes"][actor] / 2**20)
            for bucket in series
            if actor in bucket["device_bytes"]
        ]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=actor)
    axes.set(xlabel="time (s)", ylabel="resident (MiB)", title="Resident device bytes per actor")
    if actors:
        axes.legend()
    save(figure, "device_bytes_over_time.png")

    figure = Figure(figsize=(8, 4), layout="constrained")
    axes = figure.add_subplot()
    points = [(b["t"], b["hit_rate"]) for b in series if b["hit_rate"] is not None]
    axes.plot([p[0] for p in points], [p[1] for p in points])
    axes.set(xlabel="time (s)", ylabel="hit rate", title="Cache hit rate over time", ylim=(0, 1.05))
    save(figure, "hit_rate_over_time.png")

    logger.info("wrote %d plots to %s", len(written), directory)
    return written
