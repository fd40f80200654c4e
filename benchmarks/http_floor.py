"""momlp's server process beside the floor of any uvicorn server: CPU per request, same load.

Runs, alternating within each round, two servers under `vs_ray_serve.py`'s driver (same store,
workload, client and concurrency; its flags): `momlp serve` as a user runs it, and uvicorn (the
same version and defaults as momlp's: httptools, uvloop, one process) serving `_floor_app`, a
bare ASGI app that parses each JSON body and answers a momlp-shaped body of zeros, with no
access log. For each it splits the CPU time of the measured requests into the HTTP process
itself, its descendants (momlp's Ray and actors; none for the floor) and the load generator.

The floor is what the HTTP server alone costs per request here; the rest of momlp's server
process is its own path (validation, batching, routing, the actor channel, the answer).
Prints one JSON line per system and round, then one with the medians and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np
from vs_ray_serve import (
    HERE,
    ISSUE_WORKLOAD,
    MACHINE,
    MOMLP_ENV,
    CpuMeter,
    add_workload_args,
    drive,
    free_port,
    frozen_heap,
    momlp_command,
    prepare,
    served,
)


def measure(
    system: str, url: str, pid: int, work: list[Any], args: argparse.Namespace, round_: int
) -> dict[str, Any]:
    def run(part: list[Any]) -> list[Any]:
        return asyncio.run(drive(url, part, concurrency=args.concurrency, system="momlp"))

    run(work[: args.warmup])
    with frozen_heap():
        meter = CpuMeter(pid)
        start = time.perf_counter()
        records = run(work[args.warmup :])
        seconds = time.perf_counter() - start
        cpu = meter.elapsed_split()
    ok = [r for r in records if r.ok]
    latencies = sorted(r.latency_s * 1000 for r in ok)
    line: dict[str, Any] = {
        "benchmark": "http_floor",
        "system": system,
        "round": round_,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "rows_per_s": len(ok) * args.rows_per_request / seconds,
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
    }
    for part, spent in cpu.items():
        name = "http_process" if part == "root" else part
        line[f"cpu_ms_per_request_{name}"] = 1000 * spent / max(1, len(ok))
    return line


def serve(system: str, args: argparse.Namespace, store: Any, work: list[Any], round_: int) -> Any:
    port = free_port()
    if system == "momlp":
        command = momlp_command(args, store, port)
        env = dict(os.environ, **MOMLP_ENV)
        url = f"http://127.0.0.1:{port}/v1/predict"
    else:
        command = [
            sys.executable, "-m", "uvicorn", "_floor_app:app", "--app-dir", str(HERE),
            "--host", "127.0.0.1", "--port", str(port), "--no-access-log",
            "--log-level", "warning",
        ]  # fmt: skip
        env = dict(os.environ, FLOOR_OUTPUT_DIM=str(store.manifest.output_dim))
        url = f"http://127.0.0.1:{port}/"
    with served(command, env, url, {"inputs": work[0][1]}, f"{system}-") as pid:
        return measure(system, url, pid, work, args, round_)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, store="momlp-http-floor", **ISSUE_WORKLOAD)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round of 600 requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.warmup = 1, 600, 100
    store, widths, _expert_bytes, work = prepare(args)
    setup = {
        "experts": store.manifest.num_experts,
        "widths": list(widths),
        "actors": args.actors,
        "experts_per_actor": args.experts_per_actor,
        "rows_per_request": args.rows_per_request,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "client": "aiohttp",
        "machine": MACHINE,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    lines: dict[str, list[dict[str, Any]]] = {"momlp": [], "floor": []}
    for round_ in range(args.rounds):
        order = ["momlp", "floor"] if round_ % 2 == 0 else ["floor", "momlp"]
        for system in order:
            line = serve(system, args, store, work, round_) | setup
            lines[system].append(line)
            print(json.dumps(line), flush=True)
    keys = [k for k in lines["momlp"][0] if k.startswith(("rows_per_s", "p50", "p99", "cpu_"))]
    medians = {
        system: {k: statistics.median(line[k] for line in got) for k in keys}
        for system, got in lines.items()
    }
    for system, values in medians.items():
        print(json.dumps({"benchmark": "http_floor", "system": system, "stat": "median"} | values))
    momlp, floor = medians["momlp"], medians["floor"]
    http = "cpu_ms_per_request_http_process"
    print(
        json.dumps(
            {
                "benchmark": "http_floor",
                "stat": "ratio momlp / floor (medians)",
                # None when a process's CPU stayed below the clock's tick (10 ms in all).
                "http_process_cpu_ratio": momlp[http] / floor[http] if floor[http] else None,
                "floor_share_of_momlp_http_process": floor[http] / momlp[http]
                if momlp[http]
                else None,
                "momlp_http_process_above_floor_ms": momlp[http] - floor[http],
            }
            | setup
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
