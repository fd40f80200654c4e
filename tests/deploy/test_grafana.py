"""deploy/grafana/momlp-dashboard.json asks Prometheus only for series the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server import Metrics, Settings, create_app
from server.http import PoolSnapshot
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
    "momlp_actor_suspect",  # which are passed over for a health check left unanswered
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


_MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_GROUPING_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# PromQL's functions and aggregation operators (Prometheus 2.x).
PROMQL_FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bottomk", "ceil", "changes",
    "clamp", "clamp_max", "clamp_min", "count", "count_over_time", "count_values",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp",
    "floor", "group", "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log10", "log2", "max", "max_over_time", "min",
    "min_over_time", "minute", "month", "predict_linear", "present_over_time", "quantile",
    "quantile_over_time", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc",
    "sqrt", "stddev", "stddev_over_time", "stdvar", "stdvar_over_time", "sum",
    "sum_over_time", "time", "timestamp", "topk", "vector", "year",
}  # fmt: skip


def _blank_strings(expr: str) -> str:
    """`expr` with the inside of each string literal blanked, positions kept."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', lambda m: '"' + " " * (len(m.group()) - 2) + '"', expr)


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, [(label, operator, value)]) of each selector with label matchers."""
    found = []
    for match in re.finditer(rf"({_NAME})\s*\{{", _blank_strings(expr)):
        position, matchers = match.end(), []
        while (matcher := _MATCHER.match(expr, position)) is not None:
            label, operator, text = matcher.groups()
            matchers.append((label, operator, text.encode().decode("unicode_escape")))
            position = matcher.end()
        assert expr[position:].lstrip().startswith("}"), f"unreadable matchers in {expr!r}"
        found.append((match.group(1), matchers))
    return found


def selects(matchers: list[tuple[str, str, str]], labels: dict[str, str]) -> bool:
    """Whether a selector's matchers select a series of `labels` (a Grafana variable in a
    value stands for all its values)."""
    for label, operator, text in matchers:
        if "$" in text:
            continue
        have = labels.get(label, "")
        matched = re.fullmatch(text, have) is not None if "~" in operator else have == text
        if matched == operator.startswith("!"):
            return False
    return True


def check_promql(expr: str) -> None:
    """Brackets balanced and every function one PromQL has."""
    text = _blank_strings(expr)
    depth: list[str] = []
    for char in text:
        if char in "([{":
            depth.append(char)
        elif char in ")]}":
            assert depth and depth.pop() + char in ("()", "[]", "{}"), f"unbalanced: {expr!r}"
    assert not depth, f"unbalanced: {expr!r}"
    called = set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", text)) - _GROUPING_WORDS
    assert called <= PROMQL_FUNCTIONS, (sorted(called - PROMQL_FUNCTIONS), expr)


def route_templates() -> set[str]:
    """The `endpoint` label values the server can give: its route templates, "unmatched"."""
    app = create_app(Settings(store=Path("unused-store"), watch_store=False))
    return {getattr(route, "path", "") for route in app.routes} - {""} | {"unmatched"}


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, set[str]]]:
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
    pool = PoolSnapshot(
        resident_bytes={"actor-0": 1024}, budget_bytes={"actor-0": 4096},
        counts={"actor-0": CacheCounts(evictions=1, loads=3, load_bytes=3072)},
        queue_rows=2, alive={"actor-0": True}, store_version="v1", store_kind="momlp",
        refused_version="v2", failures={"actor-0": {"died": 1, "hung": 1}},
        suspect={"actor-0": True}, suspicions={"actor-0": (1, 2)},
    )
    metrics = Metrics(snapshot=lambda: pool)
    metrics.observe_request("/v1/predict", 200, 0.01)
    metrics.observe_prediction(4, [("hit", 0.0), ("miss", 3.0)])
    metrics.observe_batch(4)
    metrics.observe_closed_connection("header_timeout")
    metrics.observe_generations(1)
    text = metrics.render().decode()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def exported_names() -> set[str]:
    return set(exported_series())


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_every_query_names_an_exported_metric(dashboard: dict[str, Any]) -> None:
    exported = exported_names()
    used = set().union(*(names for _, names in dashboard_queries(dashboard)))
    missing = {
        where: sorted(names - exported)
        for where, names in dashboard_queries(dashboard)
        if names - exported
    }
    assert used <= exported, f"queries name series the server does not export: {missing}"


def test_dashboard_shows_what_the_issue_asks(dashboard: dict[str, Any]) -> None:
    used = set().union(*(names for _, names in dashboard_queries(dashboard)))
    assert REQUIRED <= used, sorted(REQUIRED - used)
    assert all(names for _, names in dashboard_queries(dashboard))


def test_panels_group_by_labels_their_series_carry(dashboard: dict[str, Any]) -> None:
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


def test_metric_names_reads_promql() -> None:
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


def test_panels_are_well_formed(dashboard: dict[str, Any]) -> None:
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


def test_every_query_is_promql_and_its_matchers_name_labels_and_endpoints_that_exist(
    dashboard: dict[str, Any],
) -> None:
    series = exported_series()
    templates = route_templates()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            check_promql(expr.replace("$__rate_interval", "1m"))
            for name, matchers in selectors(expr):
                for label, _, text in matchers:
                    assert label in series[name] | {"instance", "job"}, (panel["title"], label)
                    if label == "endpoint":
                        # A renamed route must not leave a query that selects nothing.
                        assert selects([(label, "=~", text)], {}) or any(
                            re.fullmatch(text, t) for t in templates
                        ), (panel["title"], text)


def test_the_error_share_leaves_out_the_readiness_probes(dashboard: dict[str, Any]) -> None:
    # /readyz and /v2/health/ready answer 503 by design while a server starts or drains; the
    # share counted them, so a draining server read 100 % errors.
    shares = [
        target["expr"]
        for panel in dashboard["panels"]
        if "5xx" in panel["title"]
        for target in panel["targets"]
    ]
    assert shares
    for expr in shares:
        requests = [m for name, m in selectors(expr) if name == "momlp_requests_total"]
        assert requests
        for probe in ("/readyz", "/v2/health/ready"):
            answer = {"endpoint": probe, "status": "503", "instance": "a:8000"}
            assert not any(selects(matchers, answer) for matchers in requests), (probe, expr)
        failed = {"endpoint": "/v1/predict", "status": "503", "instance": "a:8000"}
        assert all(selects(matchers, failed) for matchers in requests)
