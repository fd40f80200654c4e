"""report.html: one self-contained page (plots inlined as data URIs) of a load-test report."""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._figures import LATENCY_PERCENTILES
from ._plots import PLOT_TITLES

if TYPE_CHECKING:
    from ._report import LoadTestReport

__all__ = ["HTML_NAME", "SummaryRow", "render_html", "summary_rows", "write_html"]

HTML_NAME = "report.html"

_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


@dataclass(frozen=True)
class SummaryRow:
    """One line of the summary table: `key` is the report.json path, '/'-separated."""

    key: str
    label: str
    value: float | int | None
    text: str
    unit: str


def summary_rows(report: LoadTestReport) -> list[SummaryRow]:
    """The summary table's lines, each tied to the report.json value it shows."""
    rows: list[SummaryRow] = []

    def add(key: str, label: str, value: Any, fmt: Callable[[Any], tuple[str, str]]) -> None:
        text, unit = ("n/a", "") if value is None else fmt(value)
        rows.append(SummaryRow(key, label, value, text, unit))

    def count(value: int) -> tuple[str, str]:
        return str(value), ""

    def fixed(decimals: int, unit: str) -> Callable[[float], tuple[str, str]]:
        return lambda value: (f"{value:.{decimals}f}", unit)

    def significant(value: float) -> tuple[str, str]:
        return f"{value:.4g}", ""

    add("requests", "requests sent", report.requests, count)
    add("ok", "answered (200)", report.ok, count)
    add("errors", "failed", report.errors, count)
    if report.failure_check is not None:
        check = report.failure_check
        # Significant digits, as the CLI's line and the verdict write them: four decimals
        # showed 1 failure in 20,000 requests as 0.0000 beside an allowed 0.0000, "failed".
        add("failure_check/failed_fraction", "failed fraction", check["failed_fraction"],
            significant)
        add("failure_check/max_failed_fraction", "failed fraction allowed (--max-failed-fraction)",
            check["max_failed_fraction"], significant)
    add("rows", "rows answered", report.rows, count)
    add("duration_s", "duration", report.duration_s, fixed(2, "s"))
    rate = report.config.get("rate")
    if rate:
        add("config/rate", "asked rate (open loop)", rate, fixed(2, "req/s"))
    if report.open_loop is not None:
        loop = report.open_loop
        add("open_loop/arrivals_per_s", "arrivals scheduled", loop["arrivals_per_s"],
            fixed(2, "req/s"))
        add("open_loop/sent_per_s", "sent by the generator", loop["sent_per_s"],
            fixed(2, "req/s"))
        for key in ("p50", "p99", "max"):
            add(f"open_loop/send_lag_ms/{key}", f"sent after the arrival {key}",
                loop["send_lag_ms"][key], fixed(2, "ms"))
        add("open_loop/late", f"sent over {loop['late_ms']:g} ms late", loop["late"], count)
        add("open_loop/unsent", "never sent (no client free)", loop["unsent"], count)
    add("requests_per_s", "achieved throughput", report.requests_per_s, fixed(2, "req/s"))
    add("rows_per_s", "row throughput", report.rows_per_s, fixed(1, "rows/s"))
    for key in (*LATENCY_PERCENTILES, "max", "mean"):
        add(f"latency_ms/{key}", f"latency {key}", report.latency_ms[key], fixed(2, "ms"))
    add("hits", "cache hits", report.hits, count)
    add("misses", "cache misses", report.misses, count)
    add("loads", "waits for a load (per request and expert)", report.loads, count)
    add("hit_rate", "hit rate", report.hit_rate, fixed(4, ""))
    if report.server_counts is not None:
        counts = report.server_counts
        add("server_counts/loads", "server's loads (each once; /metrics, all traffic)",
            counts["loads"], count)
        add("server_counts/load_bytes", "server's bytes loaded", counts["load_bytes"], _bytes)
        add("server_counts/evictions", "server's evictions", counts["evictions"], count)
    for key in ("p50", "p99", "max"):
        add(f"vram_bytes/{key}", f"device memory per request {key}", report.vram_bytes[key],
            _bytes)
    add("dense_equivalent_bytes", "dense model (all experts)", report.dense_equivalent_bytes,
        _bytes)
    add("vram_ratio", "per-request p99 / dense model", report.vram_ratio,
        lambda value: (f"{value:.4g}", ""))
    add("max_expert_bytes", "largest expert file", report.max_expert_bytes, _bytes)
    add("experts_per_row", "experts per row (kept by the gate)", report.experts_per_row,
        fixed(3, ""))
    if report.conditions_served is not None:
        add("conditions_served", "conditions served (distinct θ)", report.conditions_served,
            count)
    if report.accuracy is not None:
        metric = report.accuracy["metric"]
        label = "test MSE (--eval)" if metric == "mse" else "test accuracy (--eval)"
        add("accuracy/value", label, report.accuracy["value"],
            lambda value: (f"{value:.6g}", ""))
        add("accuracy/rows", "rows scored (--eval)", report.accuracy["rows"], count)
    return rows


def render_html(
    report: LoadTestReport, directory: Path, *, generated: datetime | None = None
) -> str:
    """The page's text; plots named in `report.plots` are read from `directory` and inlined."""
    generated = generated or datetime.now(UTC)
    config, model = report.config, report.model
    load = (
        f"open loop, Poisson arrivals at {config['rate']:g} req/s"
        if config.get("rate")
        else f"closed loop, {config.get('concurrency', '?')} in flight"
    )
    facts = [
        ("server", config.get("url", "?")),
        ("store version", model.get("store_version", "?")),
        (
            "model",
            f"{model.get('num_experts', '?')} experts, input dim {model.get('input_dim', '?')}, "
            f"routing {model.get('routing', '?')}",
        ),
        ("load", load),
        (
            "requests",
            f"batch {config.get('batch', '?')} rows, top_k {config.get('top_k', '?')}, "
            f"mode {config.get('mode') or 'server default'}, "
            f"distribution {report.workload.get('distribution', config.get('distribution'))}, "
            f"seed {config.get('seed', '?')}",
        ),
        ("gate", _gate_text(config.get("gate"))),
        (
            "experts served",
            f"{len(report.expert_rows)} of {model.get('num_experts', '?')}",
        ),
        ("generated", generated.strftime("%Y-%m-%d %H:%M:%S UTC")),
    ]
    if report.failure_check is not None:
        passed = report.failure_check["passed"]
        facts.insert(-1, ("verdict", f"{'passed' if passed else 'failed'} (at most "
                          f"{report.failure_check['max_failed_fraction']:g} of the requests "
                          "may fail)"))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>momlp load test: {_e(model.get('store_version', ''))}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        "<h1>momlp load test</h1>",
        '<table class="facts">',
        *(f"<tr><th>{_e(name)}</th><td>{_e(value)}</td></tr>" for name, value in facts),
        "</table>",
        "<h2>Summary</h2>",
        '<table id="summary">',
        "<tr><th>figure</th><th>value</th><th>unit</th></tr>",
        *(
            f'<tr data-key="{_e(row.key)}"><td>{_e(row.label)}</td>'
            f'<td class="num">{_e(row.text)}</td><td>{_e(row.unit)}</td></tr>'
            for row in summary_rows(report)
        ),
        "</table>",
        "<h2>Errors by status</h2>",
        _errors_table(report),
        "<h2>Plots</h2>",
        *_figures(report, directory),
    ]
    if report.notes:
        parts += ["<h2>Notes</h2>", "<ul>", *(f"<li>{_e(note)}</li>" for note in report.notes),
                  "</ul>"]
    parts += [
        '<p class="files">Beside this page: <a href="report.json">report.json</a> (every '
        'figure), <a href="requests.csv">requests.csv</a> (one line per request).</p>',
        "</body>",
        "</html>",
    ]
    return "\n".join(parts) + "\n"


def write_html(report: LoadTestReport, directory: Path) -> Path:
    """Write `directory/report.html` (after the plots, which it inlines)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / HTML_NAME
    path.write_text(render_html(report, directory), encoding="utf-8")
    return path


def _errors_table(report: LoadTestReport) -> str:
    if not report.errors_by_status:
        return '<p id="no-errors">No failed request.</p>'
    lines = ['<table id="errors">', "<tr><th>status</th><th>requests</th><th>share</th></tr>"]
    for status, number in report.errors_by_status.items():
        share = number / report.requests if report.requests else 0.0
        lines.append(
            f'<tr data-key="errors_by_status/{_e(status)}"><td>{_e(status)}</td>'
            f'<td class="num">{number}</td><td class="num">{share:.2%}</td></tr>'
        )
    lines.append("</table>")
    return "\n".join(lines)


def _figures(report: LoadTestReport, directory: Path) -> list[str]:
    if not report.plots:
        return ['<p id="no-plots">No plots (matplotlib is not installed, or --no-plots).</p>']
    order = {name: position for position, name in enumerate(PLOT_TITLES)}
    parts = []
    for name in sorted(report.plots, key=lambda name: order.get(name, len(order))):
        data = base64.b64encode((directory / name).read_bytes()).decode("ascii")
        title = PLOT_TITLES.get(name, name)
        parts.append(
            f'<figure><img alt="{_e(title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(title)} ({_e(name)})</figcaption></figure>"
        )
    return parts


def _gate_text(gate: Any) -> str:
    if not gate:
        return "store default"
    return ", ".join(f"{key} {value}" for key, value in gate.items())


def _bytes(nbytes: float) -> tuple[str, str]:
    for unit, scale in _BYTE_UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.3f}", unit
    return f"{nbytes:.0f}", "B"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.3em; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; }
th, td { padding: 0.25em 0.8em; text-align: left; border-bottom: 1px solid #eee; }
table.facts th { color: #555; font-weight: normal; }
#summary tr:nth-child(even), #errors tr:nth-child(even) { background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1.2em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 0.9em; }
p.files { color: #555; margin-top: 2em; }
"""
