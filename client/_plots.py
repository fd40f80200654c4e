"""PNG plots of a load-test report; matplotlib is imported only here, and only when called."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._figures import LATENCY_PERCENTILES

if TYPE_CHECKING:
    from ._report import LoadTestReport

__all__ = ["PLOT_TITLES", "byte_unit", "matplotlib_available", "write_plots"]

logger = logging.getLogger(__name__)

# Every plot a report can hold, in the order report.html shows them. The open-loop and the
# error plots are written only when they have something to show.
PLOT_TITLES = {
    "latency_percentiles.png": "Latency percentiles (whole run)",
    "latency_over_time.png": "Latency percentiles over time",
    "throughput_over_time.png": "Throughput over time",
    "offered_vs_achieved.png": "Offered vs achieved rate (open loop)",
    "hit_rate_over_time.png": "Cache hit rate over time",
    "vram_per_request.png": "Device memory per request against the dense model",
    "device_bytes_over_time.png": "Resident device bytes per actor",
    "errors_by_status.png": "Errors by status",
}


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(
    report: LoadTestReport, directory: Path, *, vram_samples: list[float]
) -> list[Path]:
    """Write the report's plots into `directory`; returns their paths ([] without matplotlib).

    Always: latency percentiles, latency / throughput / hit rate / resident bytes over time,
    device memory per request. Open loop (`config["rate"]` set): offered vs achieved rate.
    With failed requests: errors by status.
    """
    try:
        # Figure without pyplot: no global state, no GUI backend, safe in threads and servers.
        from matplotlib.figure import Figure
    except ImportError:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def new_axes() -> tuple[Any, Any]:
        figure = Figure(figsize=(8, 4), layout="constrained")
        return figure, figure.add_subplot()

    def save(figure: Any, name: str) -> None:
        path = directory / name
        figure.savefig(path, dpi=100)
        written.append(path)

    series = report.time_series
    answered = [bucket for bucket in series if bucket["requests"] > 0]

    figure, axes = new_axes()
    labels = [*LATENCY_PERCENTILES, "max"]
    values = [report.latency_ms[key] for key in labels]
    bars = axes.bar(labels, values, color="tab:blue")
    axes.bar_label(bars, labels=[f"{value:.2f}" for value in values], padding=2)
    axes.set(ylabel="latency (ms)", title=f"{PLOT_TITLES['latency_percentiles.png']}, "
             f"{report.ok} answered requests")
    axes.margins(y=0.15)
    save(figure, "latency_percentiles.png")

    figure, axes = new_axes()
    for key in ("p50", "p90", "p99"):
        axes.plot(
            [b["t"] for b in answered], [b["latency_ms"][key] for b in answered], label=key
        )
    axes.set(xlabel="time (s)", ylabel="latency (ms)", title=PLOT_TITLES["latency_over_time.png"])
    axes.legend()
    save(figure, "latency_over_time.png")

    figure, axes = new_axes()
    seconds = [bucket["t"] for bucket in series]
    (requests_line,) = axes.plot(
        seconds, [bucket["requests_per_s"] for bucket in series], label="requests/s"
    )
    axes.set(xlabel="time (s)", ylabel="requests/s", title=PLOT_TITLES["throughput_over_time.png"])
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

    rate = report.config.get("rate")
    if rate:
        figure, axes = new_axes()
        axes.plot(seconds, [b.get("offered_per_s", 0.0) for b in series], label="offered/s")
        # Below the offered line where the generator fell behind its own arrivals.
        axes.plot(seconds, [b.get("sent_per_s", 0.0) for b in series], linestyle="--",
                  label="sent by the generator/s")
        axes.plot(seconds, [b["requests_per_s"] for b in series], label="achieved (answered)/s")
        axes.axhline(float(rate), color="grey", linestyle=":", label=f"target {rate:g}/s")
        axes.set(
            xlabel="time (s)", ylabel="requests/s", title=PLOT_TITLES["offered_vs_achieved.png"]
        )
        axes.legend()
        save(figure, "offered_vs_achieved.png")

    figure, axes = new_axes()
    points = [(b["t"], b["hit_rate"]) for b in series if b["hit_rate"] is not None]
    axes.plot([p[0] for p in points], [p[1] for p in points])
    axes.set(
        xlabel="time (s)",
        ylabel="hit rate",
        title=PLOT_TITLES["hit_rate_over_time.png"],
        ylim=(0, 1.05),
    )
    save(figure, "hit_rate_over_time.png")

    save(_vram_figure(Figure, report, vram_samples), "vram_per_request.png")

    figure, axes = new_axes()
    actors = sorted({actor for bucket in series for actor in bucket["device_bytes"]})
    resident_unit, resident_scale = byte_unit(
        max((n for bucket in series for n in bucket["device_bytes"].values()), default=0)
    )
    for actor in actors:
        points = [
            (bucket["t"], bucket["device_bytes"][actor] / resident_scale)
            for bucket in series
            if actor in bucket["device_bytes"]
        ]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=actor)
    axes.set(
        xlabel="time (s)",
        ylabel=f"resident ({resident_unit})",
        title=PLOT_TITLES["device_bytes_over_time.png"],
    )
    if actors:
        axes.legend()
    save(figure, "device_bytes_over_time.png")

    if report.errors_by_status:
        figure, axes = new_axes()
        statuses = list(report.errors_by_status)
        # Positions, then the statuses as tick labels: statuses given as the x values ("429",
        # "503") make matplotlib log, at INFO, that they read as numbers, on every run.
        positions = list(range(len(statuses)))
        bars = axes.bar(
            positions, [report.errors_by_status[s] for s in statuses], color="tab:red"
        )
        axes.bar_label(bars, padding=2)
        axes.set_xticks(positions, statuses)
        axes.set(
            xlabel="status",
            ylabel="requests",
            title=f"{PLOT_TITLES['errors_by_status.png']} ({report.errors} of {report.requests})",
        )
        axes.margins(y=0.15)
        save(figure, "errors_by_status.png")

    logger.info("wrote %d plots to %s", len(written), directory)
    return written


def _vram_figure(figure_type: Any, report: LoadTestReport, vram_samples: list[float]) -> Any:
    # Per-request bytes are orders of magnitude below the dense model: a histogram shows their
    # spread, a log-scale bar chart puts them beside the dense model.
    from matplotlib.ticker import NullFormatter

    figure = figure_type(figsize=(10, 4), layout="constrained")
    spread, against = figure.subplots(1, 2, width_ratios=(3, 2))
    unit, scale = byte_unit(max(vram_samples, default=0.0))
    spread.hist([value / scale for value in vram_samples], bins=40)
    spread.set(xlabel=f"vram_bytes per request ({unit})", ylabel="requests", title="Spread")
    labels = ["p50", "p99", "max"]
    values = [report.vram_bytes[key] for key in labels]
    if report.dense_equivalent_bytes:
        labels.append("dense model")
        values.append(float(report.dense_equivalent_bytes))
    colors = ["tab:blue"] * 3 + ["tab:grey"] * (len(labels) - 3)
    bars = against.bar(labels, [max(value, 1.0) for value in values], color=colors)
    against.bar_label(bars, labels=[_bytes_label(value) for value in values], padding=2,
                      fontsize="small")
    against.set(ylabel="bytes (log scale)", yscale="log", title="Per request vs dense model")
    against.yaxis.set_minor_formatter(NullFormatter())
    against.margins(y=0.2)
    figure.suptitle(PLOT_TITLES["vram_per_request.png"])
    return figure


def byte_unit(nbytes: float) -> tuple[str, float]:
    """The largest binary unit that `nbytes` reaches, and its size in bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, float(scale)
    return "B", 1.0


def _bytes_label(nbytes: float) -> str:
    unit, scale = byte_unit(nbytes)
    return f"{nbytes / scale:.3g} {unit}"
