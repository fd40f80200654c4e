"""What the client itself costs: SDK encode/decode per predict call, and load-generator capacity.

Both run against an in-process httpx.MockTransport answering instantly, so every microsecond
measured is client-side (no network, no server). The load generator's ceiling tells which
`momlp loadtest` figures are the server's and which would be the generator's.

    .venv/bin/python benchmarks/client_overhead.py [--quick]

Prints one JSON line per measured configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import statistics
import time
from typing import Any

import httpx
import numpy as np

from client import AsyncClient, Client, LoadTestConfig, arun_loadtest

OUTPUT_DIM = 4


def fake_handler(prototypes: np.ndarray) -> Any:
    """Instant answers in the v1 shapes: nearest-prototype routing, zero outputs."""
    model = {
        "store_version": "bench",
        "format_version": 1,
        "task": "regression",
        "input_dim": int(prototypes.shape[1]),
        "output_dim": OUTPUT_DIM,
        "num_experts": int(prototypes.shape[0]),
        "branching": 4,
        "routing": "tree",
        "temperature": 1.0,
        "total_expert_bytes": 10**6 * prototypes.shape[0],
        "max_expert_bytes": 10**6,
        "total_params": 10**6,
        "prototypes": prototypes.tolist(),
    }

    def rows_of(request: httpx.Request) -> np.ndarray:
        if request.headers.get("Content-Type") == "application/x-npy":
            import io

            return np.load(io.BytesIO(request.content), allow_pickle=False)
        return np.asarray(json.loads(request.content)["inputs"], dtype=np.float64)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/model":
            return httpx.Response(200, json=model)
        rows = rows_of(request)
        distances = ((rows[:, None, :] - prototypes[None, :, :]) ** 2).sum(axis=2)
        experts = distances.argmin(axis=1)
        n = len(rows)
        if request.url.path == "/v1/route":
            return httpx.Response(
                200,
                json={
                    "experts": experts[:, None].tolist(),
                    "weights": [[1.0]] * n,
                    "distances": np.sqrt(distances.min(axis=1))[:, None].tolist(),
                    "distance_evals": [len(prototypes)] * n,
                    "store_version": "bench",
                },
            )
        used = sorted(set(experts.tolist()))
        stats = [
            {
                "expert_id": e,
                "rows": int((experts == e).sum()),
                "cache": "hit",
                "load_ms": 0.0,
                "compute_ms": 0.1,
                "actor": "a0",
                "expert_bytes": 10**6,
                "activation_bytes": 1024,
                "vram_bytes": 10**6 + 1024,
            }
            for e in used
        ]
        body = {
            "outputs": [[0.0] * OUTPUT_DIM] * n,
            "experts": experts[:, None].tolist(),
            "weights": [[1.0]] * n,
            "store_version": "bench",
            "stats": {"experts": stats, "vram_bytes": 10**6 + 1024, "device_bytes": {"a0": 10**7}},
        }
        return httpx.Response(200, json=body)

    return handler


def bench_sdk(rows: int, dim: int, binary: bool, repeats: int, calls: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    prototypes = rng.normal(size=(16, dim))
    batch = rng.normal(size=(rows, dim)).astype(np.float32)
    # The answer is computed once and replayed: every measured microsecond is the client's
    # (encoding the body, httpx, decoding and validating the answer).
    request = httpx.Request(
        "POST", "http://x/v1/predict", json={"inputs": batch.tolist(), "return_stats": True}
    )
    canned = fake_handler(prototypes)(request).content
    sizes: list[int] = []

    def replay(request: httpx.Request) -> httpx.Response:
        sizes.append(len(request.content))
        return httpx.Response(200, content=canned, headers={"Content-Type": "application/json"})

    medians = []
    with Client(transport=httpx.MockTransport(replay)) as sdk:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                sdk.predict(batch, return_stats=True, binary=binary)
            medians.append((time.perf_counter() - start) / calls)
    per_call = statistics.median(medians)
    return {
        "bench": "client_sdk_predict",
        "rows": rows,
        "dim": dim,
        "body": "x-npy" if binary else "json",
        "request_bytes": sizes[0],
        "ms_per_call": round(per_call * 1e3, 4),
        "rows_per_s": round(rows / per_call, 1),
        "repeats": repeats,
        "calls_per_repeat": calls,
    }


async def bench_loadgen(requests: int, concurrency: int, batch: int, dim: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    prototypes = rng.normal(size=(64, dim))
    handler = fake_handler(prototypes)
    config = LoadTestConfig(
        requests=requests, concurrency=concurrency, batch=batch, distribution="zipf:1.1"
    )
    report = await arun_loadtest(
        config,
        client_factory=lambda cfg: AsyncClient(transport=httpx.MockTransport(handler)),
    )
    return {
        "bench": "loadtest_generator_capacity",
        "requests": report.requests,
        "concurrency": concurrency,
        "batch": batch,
        "dim": dim,
        "requests_per_s": round(report.requests_per_s, 1),
        "rows_per_s": round(report.rows_per_s, 1),
        "latency_ms_p50": round(report.latency_ms["p50"], 3),
        "errors": report.errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few seconds instead of ~a minute")
    args = parser.parse_args()
    repeats, calls = (3, 20) if args.quick else (7, 100)
    common = {"machine": platform.machine(), "python": platform.python_version()}
    for rows in (1, 64, 1024):
        for binary in (False, True):
            scale = max(1, int(math.sqrt(rows)))
            result = bench_sdk(rows, 64, binary, repeats, max(3, calls // scale))
            print(json.dumps({**result, **common}), flush=True)
    loadgen_requests = 300 if args.quick else 3000
    for concurrency, batch in ((1, 1), (16, 1), (16, 32)):
        result = asyncio.run(bench_loadgen(loadgen_requests, concurrency, batch, 16))
        print(json.dumps({**result, **common}), flush=True)


if __name__ == "__main__":
    main()
