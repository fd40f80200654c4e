"""deploy/grafana/momlp-dashboard.json asks Prometheus only for series the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server import Metrics
from server.pool import CacheCounts

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "momlp-dashboard.json"

# What the issue asks the dashboard to show, by the series that carry it.
REQUIRED = {
    "momlp_requests_total",  # request rate by endpoint
    "momlp_request_seconds_bucket",  # latency by endpoint
    "momlp_cache_hits_total",  # hit rate
    "momlp_cache_misses_total",  # hit rate, requests that waited for a load
    "momlp_expert_loads_total",  # loads, each once
    "momlp_expert_load_bytes_total",  # bytes loaded
    "momlp_expert_load_seconds_bucket",  # load latency
    "momlp_resident_bytes",  # resident bytes per actor
    "momlp_budget_bytes",  # ... against budget
    "momlp_queue_rows",  # queue depth
    "momlp_actor_alive",  # which actors answer, per instance and actor
    "momlp_connections_closed_total",  # connections the server closed unasked, by reason
}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan"}  # fmt: skip
_NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, labels or keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(_NAME, text):
        name = match.group()
        if text[match.end() :].lstrip().startswith("(") or name.lower() in _KEYWORDS:
            continue  # a function or aggregation, or an operator word
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":
            continue  # the exponent or unit of a number: 1e3, 5m
        names.add(name)
    return names


def dashboard_queries(dashboard: dict) -> list[tuple[str, set[str]]]:
    """(where, metric names) of every panel target and every templating query."""
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r}", metric_names(target["expr"])))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        found = re.match(rf"\s*label_values\(\s*({_NAME})\s*,", text)
        names = {found.group(1)} if found else metric_names(text)
        queries.append((f"variable {variable['name']!r}", names))
    return queries


def exported_series() -> dict[str, set[str]]:
    """Each series name in the server's /metrics text once every metric has a sample, with
    the names of its labels."""
    pool = SimpleNamespace(
        resident_bytes={"actor-0": 1024}, budget_bytes={"actor-0": 4096},
        counts={"actor-0": CacheCounts(evictions=1, loads=3, load_bytes=3072)},
        queue_rows=2, alive={"actor-0": True}, store_version="v1", store_kind="momlp",
        refused_version="v2",
    )
    metrics = Metrics(snapshot=lambda: pool)
    metrics.observe_request("/v1/predict", 200, 0.01)
    metrics.observe_prediction(4, [("hit", 0.0), ("miss", 3.0)])
    metrics.observe_batch(4)
    metrics.observe_closed_connection("header_timeout")
    text = metrics.render().decode()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def exported_names() -> set[str]:
    return set(exported_series())


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_query_names_an_exported_metric(dashboard):
    exported = exported_names()
    used = set().union(*(names for _, names in dashboard_queries(dashboard)))
    missing = {
        where: sorted(names - exported)
        for where, names in dashboard_queries(dashboard)
        if names - exported
    }
    assert used <= exported, f"queries name series the server does not export: {missing}"


def test_dashboard_shows_what_the_issue_asks(dashboard):
    used = set().union(*(names for _, names in dashboard_queries(dashboard)))
    assert REQUIRED <= used, sorted(REQUIRED - used)
    assert all(names for _, names in dashboard_queries(dashboard))


def test_panels_group_by_labels_their_series_carry(dashboard):
    # A `by (actor)` over a series without that label folds every actor into one line.
    series = exported_series()
    scraped = {"instance", "job"}  # added by Prometheus to every series it scrapes
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            carried = scraped.union(*(series.get(name, set()) for name in metric_names(expr)))
            for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                labels = {label.strip() for label in grouping.split(",") if label.strip()}
                assert labels <= carried, (panel["title"], sorted(labels - carried))


def test_metric_names_reads_promql():
    expr = (
        'histogram_quantile(0.99, sum by (endpoint, le) (rate(momlp_request_seconds_bucket'
        '{instance=~"$instance", status!~"2.."}[$__rate_interval]))) / on (job) group_left '
        "momlp_x_total offset 5m > bool 1e3 and ignoring(actor) momlp_y"
    )
    assert metric_names(expr) == {"momlp_request_seconds_bucket", "momlp_x_total", "momlp_y"}
    # A misspelt series is caught, so the first test can fail.
    assert metric_names("sum(rate(momlp_cache_hit_total[5m]))") - exported_names() == {
        "momlp_cache_hit_total"
    }


def test_panels_are_well_formed(dashboard):
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(set(refs)) == len(refs)
        assert all(target["datasource"]["uid"] == "${datasource}" for target in panel["targets"])
