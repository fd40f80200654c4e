"""deploy/prometheus/momlp-alerts.yaml: alerts an operator of `momlp serve` needs, over series
the server exports, with labels those series carry."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_grafana import (
    check_promql,
    exported_series,
    metric_names,
    route_templates,
    selectors,
    selects,
)

pytestmark = pytest.mark.unit

FOLDER = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = FOLDER / "momlp-alerts.yaml"
RULE_TESTS = FOLDER / "momlp-alerts.test.yaml"

# What each alert is for: the server gone, no actor, a dead, hung or silent one, errors,
# saturation, latency, a publish that never goes live, connections refused.
REQUIRED = {
    "MomlpDown": {"up"},
    "MomlpNoLiveActor": {"momlp_actor_alive"},
    "MomlpActorDown": {"momlp_actor_alive"},
    "MomlpActorHung": {"momlp_actor_failures_total"},
    "MomlpActorSuspect": {"momlp_actor_suspect"},
    "MomlpHighErrorRate": {"momlp_requests_total"},
    "MomlpSaturated": {"momlp_requests_total"},
    "MomlpSlowPredictions": {"momlp_request_seconds_bucket"},
    "MomlpStoreRefused": {"momlp_store_refused"},
    "MomlpConnectionsRefused": {"momlp_connections_closed_total"},
}
SCRAPED = {"instance", "job"}  # added by Prometheus to every series it scrapes
# Series Prometheus makes itself, with their labels.
PROMETHEUS_SERIES = {"up": SCRAPED}
CLOSE_REASONS = {"header_timeout", "over_limit", "headers_too_large"}


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_alerts_an_operator_needs_are_there(rules: list[dict[str, Any]]) -> None:
    by_name = {rule["alert"]: metric_names(rule["expr"]) for rule in rules}
    assert set(by_name) == set(REQUIRED)
    for name, series in REQUIRED.items():
        assert series == by_name[name], name


def test_each_alert_is_complete(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]


def test_every_expression_selects_exported_series_by_labels_they_carry(
    rules: list[dict[str, Any]],
) -> None:
    series = {**exported_series(), **PROMETHEUS_SERIES}
    templates = route_templates()
    for rule in rules:
        expr, name = rule["expr"], rule["alert"]
        check_promql(expr)
        assert metric_names(expr) <= set(series), (name, sorted(metric_names(expr) - set(series)))
        carried = SCRAPED.union(*(series[metric] for metric in metric_names(expr)))
        for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels = {label.strip() for label in grouping.split(",") if label.strip()}
            assert labels <= carried, (name, sorted(labels - carried))
        for metric, matchers in selectors(expr):
            for label, _, text in matchers:
                assert label in series[metric] | SCRAPED, (name, metric, label)
                # Each matcher names values the server gives: a renamed route or reason
                # would leave an alert that can never fire.
                if label == "endpoint":
                    assert any(re.fullmatch(text, t) for t in templates), (name, text)
                if label == "reason":
                    assert any(re.fullmatch(text, r) for r in CLOSE_REASONS), (name, text)
                if label == "status":
                    assert any(re.fullmatch(text, str(c)) for c in range(100, 600)), (name, text)


def test_annotations_name_only_labels_the_alert_carries(rules: list[dict[str, Any]]) -> None:
    series = {**exported_series(), **PROMETHEUS_SERIES}
    for rule in rules:
        expr = rule["expr"]
        groupings = re.findall(r"\bby\s*\(([^)]*)\)", expr)
        if groupings:
            # An aggregation keeps only its `by` labels (each of them, for a ratio of two).
            carried = set.intersection(
                *({label.strip() for label in g.split(",") if label.strip()} for g in groupings)
            )
        else:
            carried = SCRAPED.union(*(series[metric] for metric in metric_names(expr)))
        carried -= {"le"}  # histogram_quantile drops it
        for text in rule["annotations"].values():
            used = set(re.findall(r"\$labels\.(\w+)", text))
            assert used <= carried, (rule["alert"], sorted(used - carried))


def test_the_error_rate_leaves_out_the_readiness_probes(rules: list[dict[str, Any]]) -> None:
    (expr,) = [rule["expr"] for rule in rules if rule["alert"] == "MomlpHighErrorRate"]
    requests = [m for name, m in selectors(expr) if name == "momlp_requests_total"]
    for probe in ("/readyz", "/v2/health/ready"):
        answer = {"endpoint": probe, "status": "503", "instance": "a:8000"}
        assert not any(selects(matchers, answer) for matchers in requests), probe
    failed = {"endpoint": "/v1/predict", "status": "503", "instance": "a:8000"}
    assert all(selects(matchers, failed) for matchers in requests)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) not installed")
def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    for args in (["check", "rules", RULES.name], ["test", "rules", RULE_TESTS.name]):
        done = subprocess.run(
            ["promtool", *args], cwd=FOLDER, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
