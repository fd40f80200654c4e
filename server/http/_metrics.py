"""Prometheus metrics of one app, in a registry of its own (never the process-global one)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.pool import CacheCounts

__all__ = ["CONTENT_TYPE", "Metrics", "MetricsMiddleware", "PoolSnapshot"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    # A request may take body_timeout_s (30 s) to arrive and request_timeout_s (60 s) to be
    # answered: with the buckets ending at 30 s, every such request, and a 504 at the
    # timeout, fell into +Inf and histogram_quantile read it as 30 s.
    60.0,
    120.0,
)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class PoolSnapshot:
    """What the pool looks like at scrape time."""

    resident_bytes: dict[str, int] = field(default_factory=dict)
    budget_bytes: dict[str, int] = field(default_factory=dict)
    # Each actor's cache counters over the server's life (its processes' added up: a restarted
    # process counted from 0, and a scrape after its first reply saw no reset when it had
    # loaded as much again).
    counts: dict[str, CacheCounts] = field(default_factory=dict)
    queue_rows: int = 0
    alive: dict[str, bool] = field(default_factory=dict)
    # Actor -> cause ("died", "hung") -> its processes' ends the pool noticed.
    failures: dict[str, dict[str, int]] = field(default_factory=dict)
    # Actor -> whether it is a suspect now; -> (times it became one, its calls given up).
    suspect: dict[str, bool] = field(default_factory=dict)
    suspicions: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The served store version and its kind; and the version on disk that the store watcher
    # refuses to serve ("" when the manifest itself is missing), None while none is refused.
    store_version: str | None = None
    store_kind: str | None = None
    refused_version: str | None = None


class _PoolCollector(Collector):
    def __init__(self, snapshot: Callable[[], PoolSnapshot | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot() or PoolSnapshot()
        resident = GaugeMetricFamily(
            "momlp_resident_bytes", "expert bytes resident on each actor", labels=["actor"]
        )
        for actor, nbytes in sorted(snap.resident_bytes.items()):
            resident.add_metric([actor], float(nbytes))
        yield resident
        budget = GaugeMetricFamily(
            "momlp_budget_bytes", "expert cache budget of each actor", labels=["actor"]
        )
        for actor, nbytes in sorted(snap.budget_bytes.items()):
            budget.add_metric([actor], float(nbytes))
        yield budget
        yield GaugeMetricFamily(
            "momlp_queue_rows", "rows waiting to be batched or computed", value=snap.queue_rows
        )
        yield _per_actor_flag(
            "momlp_actor_alive",
            "1 while the actor answers, 0 while it is dead (restarting, or out of restarts until"
            " a new actor in its place is up)",
            snap.alive,
        )
        failures = CounterMetricFamily(
            "momlp_actor_failures",
            "processes of each actor that ended, each a restart of Ray's spent (or, once they"
            " are spent, a new actor started in its place): cause died (it died or dropped its"
            " connection) or hung (killed: no answer within MOMLP_ACTOR_CALL_TIMEOUT_S, or none to"
            " a health check or call for MOMLP_ACTOR_UNRESPONSIVE_S)",
            labels=["actor", "cause"],
        )
        for actor, causes in sorted(snap.failures.items()):
            for cause, count in sorted(causes.items()):
                failures.add_metric([actor, cause], float(count))
        yield failures
        yield from _suspicions(snap)
        info = GaugeMetricFamily(
            "momlp_store_info",
            "1 for the store version served and its kind (the series changes at a hot swap)",
            labels=["version", "kind"],
        )
        if snap.store_version is not None:
            info.add_metric([snap.store_version, snap.store_kind or ""], 1.0)
        yield info
        refused = GaugeMetricFamily(
            "momlp_store_refused",
            "1 while the store watcher refuses the version on disk (its log says why; version"
            " is empty when the manifest is missing); no sample while none is refused",
            labels=["version"],
        )
        if snap.refused_version is not None:
            refused.add_metric([snap.refused_version], 1.0)
        yield refused
        for name, documentation, field_name in (
            ("momlp_cache_evictions", "experts evicted from each actor's cache", "evictions"),
            (
                "momlp_expert_loads",
                "experts loaded into each actor's cache, once per load however many requests "
                "waited for it",
                "loads",
            ),
            (
                "momlp_expert_load_bytes",
                "bytes of the experts loaded into each actor's cache, as its budget counts them",
                "load_bytes",
            ),
        ):
            family = CounterMetricFamily(name, documentation, labels=["actor"])
            for actor, counts in sorted(snap.counts.items()):
                family.add_metric([actor], float(getattr(counts, field_name)))
            yield family


def _per_actor_flag(name: str, documentation: str, flags: dict[str, bool]) -> Metric:
    family = GaugeMetricFamily(name, documentation, labels=["actor"])
    for actor, flag in sorted(flags.items()):
        family.add_metric([actor], 1.0 if flag else 0.0)
    return family


def _suspicions(snap: PoolSnapshot) -> Iterable[Metric]:
    yield _per_actor_flag(
        "momlp_actor_suspect",
        "1 while the actor is a suspect: alive, but it left a health check unanswered, so it"
        " takes no rows until it answers one (or is taken for hung after"
        " MOMLP_ACTOR_UNRESPONSIVE_S)",
        snap.suspect,
    )
    suspicions = CounterMetricFamily(
        "momlp_actor_suspicions",
        "times each actor became a suspect (momlp_actor_suspect)",
        labels=["actor"],
    )
    given_up = CounterMetricFamily(
        "momlp_actor_calls_given_up",
        "calls in flight on an actor given up when it became a suspect: their rows ran on"
        " another actor (and, if it was only slow, twice)",
        labels=["actor"],
    )
    for actor, (times, calls) in sorted(snap.suspicions.items()):
        suspicions.add_metric([actor], float(times))
        given_up.add_metric([actor], float(calls))
    yield suspicions
    yield given_up


class Metrics:
    """The app's counters and histograms; `snapshot` is read on every scrape."""

    def __init__(self, snapshot: Callable[[], PoolSnapshot | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "momlp_requests", "HTTP requests", ["endpoint", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "momlp_request_seconds",
            "HTTP request latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rows = Counter("momlp_rows", "input rows predicted", registry=r)
        self.cache_hits = Counter(
            "momlp_cache_hits", "(request, expert) pairs served from a resident expert", registry=r
        )
        self.cache_misses = Counter(
            "momlp_cache_misses", "(request, expert) pairs that waited for a load", registry=r
        )
        self.generations = Counter(
            "momlp_generations",
            "θ generated by a hypernetwork (kind hyper): 'actor' counts generations on the "
            "actors (once per key and batch), 'generate' counts POST /v1/generate",
            ["where"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "momlp_expert_load_seconds",
            "expert load latency seen by requests",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "momlp_batch_rows",
            "(row, expert) pairs of each batch sent to the actor pool: a row routed to k experts"
            " counts k times, and a batch holds the groups of every expert it needs",
            buckets=_ROW_BUCKETS,
            registry=r,
        )
        self.connections_closed = Counter(
            "momlp_connections_closed",
            "HTTP connections the server closed unasked: 'header_timeout' (a request's headers"
            " not all in within header_timeout_s), 'over_limit' (opened while max_connections"
            " were open), 'headers_too_large' (a request's headers past their bound, 431)",
            ["reason"],
            registry=r,
        )
        self._snapshot: Callable[[], PoolSnapshot | None] = snapshot or (lambda: None)
        r.register(_PoolCollector(lambda: self._snapshot()))
        # labels() validates and looks up under a lock on every call; endpoints and statuses
        # are few (route templates), so each labelled child is looked up once.
        self._request_children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    def set_snapshot(self, snapshot: Callable[[], PoolSnapshot | None]) -> None:
        self._snapshot = snapshot

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        children = self._request_children.get((endpoint, status))
        if children is None:
            children = (
                self.requests.labels(endpoint=endpoint, status=str(status)),
                self.request_seconds.labels(endpoint=endpoint),
            )
            self._request_children[(endpoint, status)] = children
        count, latency = children
        count.inc()
        latency.observe(seconds)

    def observe_prediction(self, rows: int, caches: Sequence[tuple[str, float]]) -> None:
        """`caches`: (cache, load_ms) of each ExpertStat of one answered request."""
        self.rows.inc(rows)
        hits = 0
        for cache, load_ms in caches:
            if cache == "hit":
                hits += 1
            else:
                self.load_seconds.observe(load_ms / 1000.0)
        # One increment per counter and request (each takes a lock), not one per expert.
        if hits:
            self.cache_hits.inc(hits)
        if hits < len(caches):
            self.cache_misses.inc(len(caches) - hits)

    def observe_generations(self, count: int, where: str = "actor") -> None:
        if count:
            self.generations.labels(where=where).inc(count)

    def observe_batch(self, rows: int) -> None:
        self.batch_rows.observe(rows)

    def observe_closed_connection(self, reason: str) -> None:
        self.connections_closed.labels(reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value (tests and debugging)."""
        return self.registry.get_sample_value(name, labels or {})


class _RouteTemplates:
    """The app's route templates, to label a request that no route has claimed (yet).

    A request refused before routing (401, 413) has no route in its scope; it is labelled by
    the template its path matches (a v2 path holds the model's name, which the client picks),
    so that label values stay as few as the routes whatever paths clients send.
    """

    def __init__(self, templates: Collection[str]) -> None:
        ordered = [t for t in dict.fromkeys(templates) if t]
        self._literal = frozenset(t for t in ordered if "{" not in t)
        self._patterns: list[tuple[re.Pattern[str], str]] = [
            (compile_path(t)[0], t) for t in ordered if "{" in t
        ]

    def label(self, path: str) -> str:
        if path in self._literal:
            return path
        for pattern, template in self._patterns:
            if pattern.match(path):
                return template
        return "unmatched"


def _endpoint(scope: Scope, templates: _RouteTemplates) -> str:
    # The route template, not the raw path, so that label values stay few.
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    return templates.label(scope["path"])


class MetricsMiddleware:
    """Counts every HTTP answer by endpoint and status and times it (outermost middleware).

    `known_paths`: the app's route templates (`route.path`), in the router's order.
    """

    def __init__(
        self, app: ASGIApp, *, metrics: Metrics, known_paths: Collection[str] = ()
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.templates = _RouteTemplates(known_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        finally:
            self.metrics.observe_request(
                _endpoint(scope, self.templates), status, time.perf_counter() - start
            )
