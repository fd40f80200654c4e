"""Hypernetwork serving under Zipf traffic over conditions (issue 17, item 4).

A hyper store (rotate-digits: f of depth 4, width 100 → θ of g: 64 → 10 → 12, trained a few
epochs) is served by a real app over two Ray actors, each with room for f (pinned) and 100 θ.
`momlp loadtest --conditions 1000 --condition-distribution zipf:1.0` drives it (closed loop).
Printed, one JSON line: hit rate, generations, the largest resident bytes any actor reported
against its budget, and VRAM per request (p50/p99/max) against the bound
|f| + (distinct conditions in the request)·|θ| + activations, checked request by request.

    python benchmarks/hyper_loadtest.py [--quick] [--report DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from client import LoadTestConfig, run_loadtest
from client._conditions import ConditionWorkload
from server import Settings, create_app
from server.pool import activation_peak_bytes, ray_session
from trainer.hyper import HyperBuildConfig, build_hyper_store

ROOM = 100  # θ per actor besides f


def serve(settings: Settings) -> tuple[Any, threading.Thread, str]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=0,
                                           log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs, 1,500 requests")
    parser.add_argument("--report", type=Path, default=None, help="loadtest report directory")
    parser.add_argument("--conditions", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    requests = 1500 if args.quick else 5000
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        manifest = build_hyper_store(
            HyperBuildConfig(out=store, dataset="rotate-digits", epochs=2 if args.quick else 10),
            progress=False,
        )
        spec = manifest.hyper
        assert spec is not None
        f_bytes, theta = 4 * spec.hypernetwork.params, spec.theta_nbytes
        budget = f_bytes + ROOM * theta
        settings = Settings(store=store, port=0, actors=2, cache_bytes=budget, watch_store=False,
                            max_conditions=args.batch, cache_policy="tinylfu")
        with ray_session(num_cpus=2):
            server, thread, url = serve(settings)
            try:
                config = LoadTestConfig(
                    url=url, requests=requests, concurrency=8, batch=args.batch,
                    conditions=args.conditions,
                    condition_distribution=f"zipf:{args.zipf:g}", report_dir=args.report,
                    save_requests=True, plots=args.report is not None,
                )
                report = run_loadtest(config)
                metrics = httpx.get(f"{url}/metrics").text
            finally:
                server.should_exit = True
                thread.join(timeout=60)
    # The same seeded workload again, to know each request's distinct conditions.
    replay = ConditionWorkload(_model(report), conditions=args.conditions,
                               distribution=_law(config), seed=config.seed)
    distinct = []
    for _ in range(requests):
        replay.next_request(args.batch)
        distinct.append(replay.distinct_per_request[-1])
    activation = activation_peak_bytes(spec.primary.widths, args.batch)
    records = [r for r in report.records or [] if r["status"] == "200"]
    over_bound = [
        r["index"] for r in records
        if r["vram_bytes"] is not None
        and r["vram_bytes"] > f_bytes + distinct[r["index"]] * theta + activation
    ]
    resident_max = max((b for r in records for b in r["device_bytes"].values()), default=0)
    generations = _metric(metrics, 'momlp_generations_total{where="actor"}')
    print(json.dumps({
        "bench": "hyper_loadtest",
        "requests": report.requests, "ok": report.ok, "batch": args.batch,
        "conditions": args.conditions, "law": f"zipf:{args.zipf:g}",
        "f_bytes": f_bytes, "theta_bytes": theta, "budget_bytes_per_actor": budget,
        "room_theta": ROOM,
        "hit_rate": report.hit_rate, "hits": report.hits, "misses": report.misses,
        "generations": generations,
        "resident_bytes_max": resident_max, "resident_within_budget": resident_max <= budget,
        "vram_bytes": report.vram_bytes,
        "vram_bound_p99": f_bytes + theta + activation,
        "requests_over_bound": len(over_bound),
        "distinct_per_request_mean": sum(distinct) / len(distinct),
        "latency_ms": {k: round(v, 2) for k, v in report.latency_ms.items()},
        "requests_per_s": round(report.requests_per_s, 1),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }), flush=True)


def _model(report: Any) -> Any:
    from client import ModelInfo

    return ModelInfo.model_validate(report.model)


def _law(config: LoadTestConfig) -> Any:
    from client._workload import Distribution

    return Distribution.parse(config.condition_distribution)


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return None


if __name__ == "__main__":
    main()
