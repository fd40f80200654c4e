"""A fake momlp server for the client tests: the v1 JSON contract over httpx.MockTransport.

It routes by brute-force nearest prototype, computes outputs with a closed form
(sum(row) x (expert + 1)), keeps an LRU cache per actor to report hits and misses, and counts
everything it sees so tests can compare the client's figures with an independent tally.
Defined here (not in an importable module) so it works under any pytest import mode.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest


class FakeClock:
    """Monotonic seconds that move only when told; `sleep` advances it."""

    def __init__(self, start: float = 100.0) -> None:
        self.t = start
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


def error_response(status: int, code: str, message: str = "", detail: Any = None, **headers: str):
    body = {"error": {"code": code, "message": message or code, "detail": detail}}
    return httpx.Response(status, json=body, headers=headers)


class FakeServer:
    def __init__(
        self,
        prototypes: list[list[float]],
        *,
        api_key: str | None = None,
        cache_capacity: int = 3,
        clock: FakeClock | None = None,
        service_s: float = 0.004,
        miss_s: float = 0.010,
        max_rows: int = 10_000,
        temperature: float = 1.0,
    ) -> None:
        self.prototypes = [list(map(float, p)) for p in prototypes]
        self.input_dim = len(self.prototypes[0])
        self.api_key = api_key
        self.cache_capacity = cache_capacity
        self.clock = clock
        self.service_s = service_s
        self.miss_s = miss_s
        self.max_rows = max_rows
        self.temperature = temperature
        self.actor = "actor-0"
        self.cache: OrderedDict[int, int] = OrderedDict()
        self.expert_bytes = {e: 4096 + 64 * e for e in range(len(self.prototypes))}
        # Tallies the tests compare against.
        self.calls: Counter[str] = Counter()
        self.predict_requests = 0
        self.predict_rows = 0
        self.hits = 0
        self.misses = 0
        self.rows_by_expert: Counter[int] = Counter()
        self.request_vram: list[int] = []
        self.service_times: list[float] = []
        self.content_types: list[str] = []
        self.fail_next: list[httpx.Response | Exception] = []
        self.fail_every: tuple[int, httpx.Response] | None = None

    @property
    def total_expert_bytes(self) -> int:
        return sum(self.expert_bytes.values())

    def route_rows(self, rows: list[list[float]], top_k: int) -> tuple[list, list, list]:
        experts, weights, distances = [], [], []
        for row in rows:
            d = [math.dist(row, p) for p in self.prototypes]
            order = sorted(range(len(d)), key=lambda i: (d[i], i))[:top_k]
            logits = [-(d[i] ** 2) / self.temperature for i in order]
            top = max(logits)
            exp = [math.exp(v - top) for v in logits]
            experts.append(order)
            weights.append([v / sum(exp) for v in exp])
            distances.append([d[i] for i in order])
        return experts, weights, distances

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls[path] += 1
        if self.fail_next:
            failure = self.fail_next.pop(0)
            if isinstance(failure, Exception):
                raise failure
            return failure
        if self.api_key and path != "/healthz":
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                response = error_response(401, "unauthorized", "bad key")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        if path == "/healthz":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/readyz":
            return httpx.Response(200, json={"status": "ready", "store_version": "v1"})
        if path == "/metrics":
            text = f"momlp_cache_hits_total {self.hits}\nmomlp_cache_misses_total {self.misses}\n"
            return httpx.Response(200, text=text)
        if path == "/v1/model":
            return httpx.Response(200, json=self.model_json(request))
        if path == "/v1/experts":
            return httpx.Response(200, json=self.experts_json())
        if path == "/v1/route":
            return self.route(request)
        if path == "/v1/predict":
            if self.fail_every is not None:
                every, response = self.fail_every
                if (self.calls[path] % every) == 0:
                    return response
            return self.predict(request)
        return error_response(404, "not_found")

    def model_json(self, request: httpx.Request) -> dict[str, Any]:
        with_prototypes = request.url.params.get("include_prototypes") == "true"
        return {
            "store_version": "v1",
            "format_version": 1,
            "task": "regression",
            "input_dim": self.input_dim,
            "output_dim": 1,
            "num_experts": len(self.prototypes),
            "branching": 4,
            "routing": "tree",
            "temperature": self.temperature,
            "total_expert_bytes": self.total_expert_bytes,
            "max_expert_bytes": max(self.expert_bytes.values()),
            "total_params": self.total_expert_bytes // 4,
            "prototypes": self.prototypes if with_prototypes else None,
        }

    def experts_json(self) -> dict[str, Any]:
        return {
            "experts": [
                {"id": e, "bytes": b, "params": b // 4, "actors": [self.actor] * (e in self.cache)}
                for e, b in self.expert_bytes.items()
            ],
            "actors": [
                {
                    "name": self.actor,
                    "device": "cpu",
                    "resident_bytes": sum(self.cache.values()),
                    "budget_bytes": 10**6,
                    "resident": list(self.cache),
                    "alive": True,
                }
            ],
        }

    def _inputs(
        self, request: httpx.Request
    ) -> tuple[list[list[float]], dict[str, Any]] | httpx.Response:
        content_type = request.headers.get("Content-Type", "")
        self.content_types.append(content_type)
        if content_type == "application/x-npy":
            array = np.load(io.BytesIO(request.content), allow_pickle=False)
            params = request.url.params
            options = {
                "top_k": int(params.get("top_k", "1")),
                "mode": params.get("mode"),
                "return_stats": params.get("return_stats") == "true",
            }
            return array.astype(np.float64).tolist(), options
        body = json.loads(request.content)
        inputs = body.get("inputs")
        if not isinstance(inputs, list) or not inputs:
            return error_response(422, "invalid_input", "inputs must be a non-empty list")
        return inputs, body

    def route(self, request: httpx.Request) -> httpx.Response:
        parsed = self._inputs(request)
        if isinstance(parsed, httpx.Response):
            return parsed
        rows, options = parsed
        if len(rows) > self.max_rows:
            return error_response(413, "payload_too_large", detail={"max_rows": self.max_rows})
        experts, weights, distances = self.route_rows(rows, int(options.get("top_k") or 1))
        return httpx.Response(
            200,
            json={
                "experts": experts,
                "weights": weights,
                "distances": distances,
                "distance_evals": [len(self.prototypes)] * len(rows),
                "store_version": "v1",
            },
        )

    def predict(self, request: httpx.Request) -> httpx.Response:
        parsed = self._inputs(request)
        if isinstance(parsed, httpx.Response):
            return parsed
        rows, options = parsed
        if len(rows) > self.max_rows:
            return error_response(413, "payload_too_large", detail={"max_rows": self.max_rows})
        if any(len(row) != self.input_dim for row in rows):
            return error_response(422, "invalid_input", "wrong dimension")
        experts, weights, _ = self.route_rows(rows, int(options.get("top_k") or 1))
        outputs = [
            [sum(w * sum(row) * (e + 1) for e, w in zip(es, ws, strict=True))]
            for row, es, ws in zip(rows, experts, weights, strict=True)
        ]
        rows_per_expert: Counter[int] = Counter(e for es in experts for e in es)
        stats = []
        misses = 0
        for expert, count in sorted(rows_per_expert.items()):
            hit = expert in self.cache
            if hit:
                self.cache.move_to_end(expert)
                self.hits += 1
            else:
                misses += 1
                self.misses += 1
                self.cache[expert] = self.expert_bytes[expert]
                while len(self.cache) > self.cache_capacity:
                    self.cache.popitem(last=False)
            self.rows_by_expert[expert] += count
            activation = count * 32 * 4
            stats.append(
                {
                    "expert_id": expert,
                    "rows": count,
                    "cache": "hit" if hit else "miss",
                    "load_ms": 0.0 if hit else 1.5,
                    "compute_ms": 0.1,
                    "actor": self.actor,
                    "expert_bytes": self.expert_bytes[expert],
                    "activation_bytes": activation,
                    "vram_bytes": self.expert_bytes[expert] + activation,
                }
            )
        vram = max(s["vram_bytes"] for s in stats)
        self.predict_requests += 1
        self.predict_rows += len(rows)
        self.request_vram.append(vram)
        service = self.service_s + self.miss_s * misses
        self.service_times.append(service)
        if self.clock is not None:
            self.clock.advance(service)
        body: dict[str, Any] = {
            "outputs": outputs,
            "experts": experts,
            "weights": weights,
            "store_version": "v1",
            "stats": None,
        }
        if options.get("return_stats"):
            body["stats"] = {
                "experts": stats,
                "vram_bytes": vram,
                "device_bytes": {self.actor: sum(self.cache.values())},
                "distance_evals": [len(self.prototypes)] * len(rows),
                "route_ms": 0.01,
                "queue_ms": 0.0,
                "total_ms": service * 1000,
            }
        return httpx.Response(200, json=body)


def grid_prototypes(side: int = 4, spacing: float = 1.0) -> list[list[float]]:
    """side x side points on a grid in 2-D: nearest-prototype spacing is exactly `spacing`."""
    return [[i * spacing, j * spacing] for i in range(side) for j in range(side)]


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_server(fake_clock: FakeClock) -> Callable[..., FakeServer]:
    def make(prototypes: list[list[float]] | None = None, **kwargs: Any) -> FakeServer:
        kwargs.setdefault("clock", fake_clock)
        return FakeServer(prototypes or grid_prototypes(), **kwargs)

    return make


@pytest.fixture
def fake_server(make_server: Callable[..., FakeServer]) -> FakeServer:
    return make_server()


@pytest.fixture
def make_error() -> Callable[..., httpx.Response]:
    return error_response


@pytest.fixture
def grid() -> Callable[..., list[list[float]]]:
    return grid_prototypes


@pytest.fixture(scope="session")
def fakes() -> SimpleNamespace:
    """The fake server's parts, for fixtures wider than one test (e.g. a report built once)."""
    return SimpleNamespace(
        FakeServer=FakeServer,
        FakeClock=FakeClock,
        grid_prototypes=grid_prototypes,
        error_response=error_response,
    )
