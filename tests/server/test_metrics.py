"""GET /metrics of a real server (uvicorn on loopback, driven with httpx) against the traffic a
client sent: counters, histograms and gauges, read with Prometheus' own text parser."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from app_support import BlockingPool, app_settings, build_small_store, fake_app, republish
from prometheus_client.parser import text_string_to_metric_families
from test_connections import serving

from server import Metrics, Settings, create_app
from server.http._v2 import model_name
from server.pool import ExpertPool, FakeExpertPool

pytestmark = pytest.mark.unit

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return build_small_store(tmp_path / "store")


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """`app` under uvicorn on 127.0.0.1 as `momlp serve` runs it (uvicorn runs its lifespan),
    and a client of it."""
    async with serving(app, header_timeout_s=30.0) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield client


async def scrape(client: httpx.AsyncClient, **kwargs: Any) -> tuple[str, Samples]:
    answer = await client.get("/metrics", **kwargs)
    assert answer.status_code == 200, answer.text
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }
    return answer.text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def labelled(samples: Samples, name: str, label: str) -> dict[str, float]:
    """label value -> sum of `name` over its other labels."""
    found: dict[str, float] = {}
    for (sample, labels), number in samples.items():
        if sample == name:
            key = dict(labels)[label]
            found[key] = found.get(key, 0.0) + number
    return found


def _inputs(rows: int, seed: int = 0) -> list[list[float]]:
    rows_: list[list[float]] = np.random.default_rng(seed).normal(size=(rows, 4)).tolist()
    return rows_


async def test_the_queue_gauge_counts_rows_still_queued_in_a_version_replaced_by_a_swap(
    store: Path,
) -> None:
    # A request keeps the version it entered; at a swap the gauge read only the new version's
    # batcher and fell to 0 while the old one still held the request's rows.
    pools: list[BlockingPool] = []

    def blocking(settings: Settings) -> ExpertPool:
        pools.append(BlockingPool(FakeExpertPool(settings)))
        return pools[-1]

    app = create_app(app_settings(store), pool_factory=blocking)
    async with served(app) as client:
        pending = asyncio.create_task(client.post("/v1/predict", json={"inputs": _inputs(5)}))
        await pools[0].entered.wait()
        _, before = await scrape(client)
        new_version = republish(store, seed=1)
        reloaded = (await client.post("/v1/admin/reload")).json()
        _, during = await scrape(client)
        pools[0].gate.set()
        answer = await pending
        _, after = await scrape(client)
    assert reloaded["reloaded"] and reloaded["store_version"] == new_version
    assert value(before, "momlp_queue_rows") == 5.0
    assert value(during, "momlp_store_info", version=new_version, kind="momlp") == 1.0
    assert value(during, "momlp_queue_rows") == 5.0
    assert answer.status_code == 200
    assert value(after, "momlp_queue_rows") == 0.0


async def test_a_swap_does_not_admit_rows_past_the_queue_limit(store: Path) -> None:
    # The limit was checked against the new version's batcher alone: while a replaced version
    # still held its rows, a swap admitted up to twice `max_queue_rows`.
    pools: list[BlockingPool] = []

    def blocking(settings: Settings) -> ExpertPool:
        pools.append(BlockingPool(FakeExpertPool(settings)))
        return pools[-1]

    app = create_app(app_settings(store, max_queue_rows=8), pool_factory=blocking)
    async with served(app) as client:
        pending = asyncio.create_task(client.post("/v1/predict", json={"inputs": _inputs(5)}))
        await pools[0].entered.wait()
        republish(store, seed=1)
        assert (await client.post("/v1/admin/reload")).json()["reloaded"]
        refused = await asyncio.wait_for(
            client.post("/v1/predict", json={"inputs": _inputs(5, seed=1)}), 30
        )
        pools[0].gate.set()
        assert (await pending).status_code == 200
        admitted = await client.post("/v1/predict", json={"inputs": _inputs(5, seed=1)})
    assert refused.status_code == 429, refused.text
    assert "(5 of 8 rows)" in refused.json()["error"]["message"]  # the replaced version's
    assert admitted.status_code == 200  # once the old version's rows are answered


async def test_requests_refused_before_routing_are_labelled_by_their_route_template(
    store: Path,
) -> None:
    # Without the key, a v2 path (which holds a model name the client picks) was labelled
    # "unmatched", so a dashboard by endpoint lost the v2 endpoints' 401s.
    settings = app_settings(store, api_key="secret")
    app = create_app(settings, pool_factory=lambda s: FakeExpertPool(s))
    served_name = model_name(settings)
    v2_body = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                           "data": [0.1, 0.2, 0.3, 0.4]}]}  # fmt: skip
    key = {"Authorization": "Bearer secret"}
    rng = random.Random(0)
    async with served(app) as client:
        for _ in range(3):
            await client.post(f"/v2/models/{served_name}/infer", json=v2_body)
        answer = await client.post(f"/v2/models/{served_name}/infer", json=v2_body, headers=key)
        assert answer.status_code == 200, answer.text
        # Model names, versions and paths a client makes up: each its own value to a label
        # that took the raw path.
        for index in range(40):
            name = f"model-{rng.getrandbits(64):x}"
            await client.post(f"/v2/models/{name}/versions/{index}/infer", json=v2_body)
            await client.get(f"/v2/models/{name}/ready", headers=key)
            await client.get(f"/no/such/path/{index}", headers=key)
        _, samples = await scrape(client, headers=key)
    templates = {getattr(route, "path", "") for route in app.routes}
    endpoints = labelled(samples, "momlp_requests_total", "endpoint")
    assert set(endpoints) <= templates | {"unmatched"}
    unauthorised = {
        dict(labels)["endpoint"]: number
        for (name, labels), number in samples.items()
        if name == "momlp_requests_total" and dict(labels)["status"] == "401"
    }
    assert unauthorised == {
        "/v2/models/{name}/infer": 3.0,
        "/v2/models/{name}/versions/{version}/infer": 40.0,
    }
    assert value(samples, "momlp_requests_total", endpoint="/v2/models/{name}/ready",
                 status="404") == 40.0  # fmt: skip
    assert value(samples, "momlp_requests_total", endpoint="unmatched", status="404") == 40.0


async def test_counters_equal_what_the_client_sent(store: Path) -> None:
    sent_rows = 0
    async with served(fake_app(store)) as client:
        for index in range(6):
            rows = 1 + index % 3
            answer = await client.post("/v1/predict", json={"inputs": _inputs(rows, index)})
            assert answer.status_code == 200
            sent_rows += rows
        await client.post("/v1/route", json={"inputs": _inputs(2)})
        await client.post("/v1/predict", json={"inputs": [[1.0]]})  # 422
        await client.get("/healthz")
        text, samples = await scrape(client)
    requests = labelled(samples, "momlp_requests_total", "endpoint")
    assert requests == {"/v1/predict": 7.0, "/v1/route": 1.0, "/healthz": 1.0}
    assert value(samples, "momlp_requests_total", endpoint="/v1/predict", status="422") == 1.0
    assert value(samples, "momlp_request_seconds_count", endpoint="/v1/predict") == 7.0
    assert value(samples, "momlp_rows_total") == sent_rows
    pairs = value(samples, "momlp_cache_hits_total") + value(samples, "momlp_cache_misses_total")
    assert pairs >= 6  # one (request, expert) pair at least per answered predict
    assert value(samples, "momlp_batch_rows_sum") == sent_rows
    # Every family is documented and typed, as Prometheus' own parser reads them.
    families = list(text_string_to_metric_families(text))
    assert families and all(family.documentation for family in families)
    for family in families:
        if family.name.endswith("_created"):
            continue  # the client library's creation time of each counter and histogram
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if "bytes" in family.name or "seconds" in family.name:
            assert family.name.endswith(("_bytes", "_seconds", "_bytes_total")), family.name


async def test_batch_rows_count_row_expert_pairs_as_their_help_says(store: Path) -> None:
    async with served(fake_app(store)) as client:
        answer = await client.post("/v1/predict", json={"inputs": _inputs(5), "top_k": 2})
        text, samples = await scrape(client)
    assert answer.status_code == 200
    # One batch of 5 rows, each routed to 2 experts: 10 pairs in one observation.
    assert value(samples, "momlp_batch_rows_count") == 1.0
    assert value(samples, "momlp_batch_rows_sum") == 10.0
    assert value(samples, "momlp_rows_total") == 5.0
    (help_line,) = [ln for ln in text.splitlines() if ln.startswith("# HELP momlp_batch_rows ")]
    assert "(row, expert) pairs" in help_line


def _quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over one histogram's cumulative buckets {le: count}."""
    bounds = sorted(buckets)
    rank = q * buckets[math.inf]
    below, count_below = 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == math.inf:
                return bounds[-2]  # the highest finite bound: all Prometheus can say
            inside = buckets[bound] - count_below
            return below + (bound - below) * (rank - count_below) / inside
        below, count_below = bound, buckets[bound]
    raise AssertionError("no +Inf bucket")


def test_requests_that_run_into_their_timeouts_are_measured_not_cut_at_30_s() -> None:
    # A predict may wait body_timeout_s for its body and request_timeout_s for its answer; a
    # p99 of such requests read 30 s (the last finite bucket) whatever they took.
    defaults = Settings()
    metrics = Metrics()
    for _ in range(100):
        metrics.observe_request("/v1/predict", 504, defaults.request_timeout_s)
    buckets = {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name == "momlp_request_seconds_bucket"
    }
    assert _quantile(0.99, buckets) == pytest.approx(defaults.request_timeout_s, rel=0.05)
    longest = defaults.body_timeout_s + defaults.request_timeout_s
    assert max(bound for bound in buckets if bound != math.inf) >= longest
