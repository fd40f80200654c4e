"""report.html, read as a browser would (stdlib html.parser): its numbers are report.json's."""

from __future__ import annotations

import asyncio
import base64
import csv
import json
import re
from dataclasses import replace
from html.parser import HTMLParser

import httpx
import numpy as np
import pytest

from client import AsyncClient, LoadTestConfig, arun_loadtest
from client._html import render_html

pytestmark = pytest.mark.unit

BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


class Page(HTMLParser):
    """Table rows by table id, images, and every address the page refers to."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[tuple[str | None, list[str]]]] = {}
        self.images: list[dict[str, str | None]] = []
        self.addresses: list[str] = []
        self._table: str | None = None
        self._row: tuple[str | None, list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.addresses += [value for key, value in attrs if key in ("src", "href") and value]
        if tag == "table":
            self._table = attributes.get("id") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self._row = (attributes.get("data-key"), [])
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "img":
            self.images.append(attributes)
        elif tag in ("link", "script", "iframe", "object", "embed"):
            self.addresses.append(f"<{tag}>")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row[1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def lookup(data: dict, key: str):
    for part in key.split("/"):
        data = data[part]
    return data


def tolerance(text: str) -> float:
    """Half a unit of the last digit shown: what rounding for display may have cost."""
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (-decimals) * 10.0 ** int(exponent or 0)


@pytest.fixture(scope="module")
def open_loop_report(fakes, tmp_path_factory):
    """One open-loop run with failures and misses, its report written once for the module."""
    pytest.importorskip("matplotlib")
    clock = fakes.FakeClock()
    server = fakes.FakeServer(fakes.grid_prototypes(), clock=clock, cache_capacity=3)
    server.fail_every = (7, fakes.error_response(503, "not_ready"))
    directory = tmp_path_factory.mktemp("report")
    config = LoadTestConfig(
        requests=80, rate=150.0, batch=3, distribution="zipf:1.1", seed=4, report_dir=directory
    )

    def factory(config: LoadTestConfig) -> AsyncClient:
        return AsyncClient(transport=httpx.MockTransport(server.handler), max_retries=0)

    report = asyncio.run(
        arun_loadtest(config, client_factory=factory, clock=clock, sleep=clock.sleep)
    )
    return report, directory


def test_summary_table_shows_report_json_figures(open_loop_report):
    report, directory = open_loop_report
    data = json.loads((directory / "report.json").read_text())
    page = Page()
    page.feed((directory / "report.html").read_text())
    rows = {key: cells for key, cells in page.tables["summary"] if key is not None}
    expected_keys = {
        "requests",
        "ok",
        "errors",
        "rows",
        "duration_s",
        "config/rate",
        "requests_per_s",
        "rows_per_s",
        "hits",
        "misses",
        "loads",
        "hit_rate",
        "dense_equivalent_bytes",
        "vram_ratio",
        "max_expert_bytes",
        "experts_per_row",
        *(f"latency_ms/{key}" for key in ("p50", "p90", "p95", "p99", "p99.9", "max", "mean")),
        *(f"vram_bytes/{key}" for key in ("p50", "p99", "max")),
        # Whether the generator sent at the asked rate (an open loop's own figures).
        "open_loop/arrivals_per_s",
        "open_loop/sent_per_s",
        *(f"open_loop/send_lag_ms/{key}" for key in ("p50", "p99", "max")),
        "open_loop/late",
        "open_loop/unsent",
    }
    assert set(rows) == expected_keys
    for key, (_label, text, unit) in rows.items():
        value = lookup(data, key)
        shown = float(text) * BYTE_UNITS.get(unit, 1)
        allowed = tolerance(text) * BYTE_UNITS.get(unit, 1)
        assert abs(shown - value) <= allowed * (1 + 1e-9), (key, text, unit, value)
    # The run had what makes the page interesting: failures, misses, an open loop.
    assert data["errors"] > 0 and 0 < data["hit_rate"] < 1 and data["config"]["rate"] == 150.0
    assert float(rows["latency_ms/p99.9"][1]) >= float(rows["latency_ms/p99"][1])


def test_errors_table_matches_report_json(open_loop_report):
    report, directory = open_loop_report
    data = json.loads((directory / "report.json").read_text())
    page = Page()
    page.feed((directory / "report.html").read_text())
    shown = {key: int(cells[1]) for key, cells in page.tables["errors"] if key is not None}
    assert shown == {f"errors_by_status/{k}": v for k, v in data["errors_by_status"].items()}
    assert data["errors_by_status"] == {"503": 80 // 7}


def test_page_is_self_contained_with_every_plot_inlined(open_loop_report):
    report, directory = open_loop_report
    page = Page()
    page.feed((directory / "report.html").read_text())
    assert "offered_vs_achieved.png" in report.plots and "errors_by_status.png" in report.plots
    assert len(page.images) == len(report.plots) == 8
    for image in page.images:
        src = image["src"] or ""
        assert src.startswith("data:image/png;base64,")
        png = base64.b64decode(src.partition(",")[2], validate=True)
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert any(png == (directory / name).read_bytes() for name in report.plots)
    # Nothing to fetch: every address is inline data or a file beside the page.
    for address in page.addresses:
        assert address.startswith("data:") or address in ("report.json", "requests.csv"), address


def test_csv_beside_the_page_holds_every_request(open_loop_report):
    report, directory = open_loop_report
    with (directory / "requests.csv").open(newline="") as stream:
        lines = list(csv.DictReader(stream))
    assert [int(line["index"]) for line in lines] == list(range(80))
    ok = [line for line in lines if line["status"] == "200"]
    assert len(ok) == report.ok and sum(int(line["rows"]) for line in ok) == report.rows
    latencies = [float(line["latency_ms"]) for line in ok]
    for key, q in (("p50", 50), ("p99", 99), ("p99.9", 99.9)):
        assert report.latency_ms[key] == pytest.approx(np.percentile(latencies, q), abs=1e-3)
    assert sum(int(line["hits"]) for line in ok) == report.hits
    expert_rows: dict[str, int] = {}
    for line in ok:
        for pair in line["expert_rows"].split():
            expert, _, count = pair.partition(":")
            expert_rows[expert] = expert_rows.get(expert, 0) + int(count)
    assert expert_rows == report.expert_rows
    failed = [line for line in lines if line["status"] != "200"]
    assert {line["status"] for line in failed} == {"503"} and all(
        line["vram_bytes"] == "" for line in failed
    )


def test_page_escapes_what_it_did_not_write(open_loop_report):
    report, directory = open_loop_report
    hostile = replace(report, notes=["<script>alert(1)</script>"])
    text = render_html(hostile, directory)
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert re.search(r"<title>momlp load test: v1</title>", text)
