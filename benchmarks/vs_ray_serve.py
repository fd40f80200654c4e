"""momlp vs Ray Serve model multiplexing: same store, same actors, same bytes, same load.

Both systems serve one store of K random-weight PReLU experts (K >= 200; a serving benchmark
needs realistic sizes, not trained weights) on `--actors` CPU actors / replicas (1 CPU, 1
torch thread each) with room for `--experts-per-actor` experts each: momlp through
`momlp serve --cache-bytes B` (a subprocess, its own embedded Ray), the baseline through one
Ray Serve deployment whose replicas route the rows themselves and load experts through
`@serve.multiplexed(max_num_models_per_replica = B // expert bytes)` (benchmarks/_rayserve_app.py).

The same driver (`--client`: aiohttp by default, or httpx; closed loop, `--concurrency` requests
in flight) sends both the same seeded sequence of requests of `--rows-per-request` rows (default
1) whose experts follow Zipf(1.0) over the experts ranked by a seeded permutation; each row is
drawn near its expert's prototype and verified to route there. A Ray Serve HTTP request names
one multiplexed model (header `serve_multiplexed_model_id`), so the driver sends the first row's
expert in that header and Serve's Python proxy can prefer a replica that holds it (HAProxy, in
front with the high-throughput setting, balances by least connections instead); the replica
routes the rows and loads the other experts itself. momlp ignores the header and routes on
the server. Each round runs both systems one after the other (the order alternates), each from
a cold start; the first `--warmup` requests are not measured.

Ray Serve runs in its best documented configuration for throughput by default
(`--rayserve-config best`: `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` and `RAY_SERVE_ENABLE_HA_PROXY=1`,
both in Ray >= 2.55, set before its processes start, and `max_ongoing_requests` raised from 5
to `--concurrency`, as its performance guide advises for async callables);
`--rayserve-config default` runs its defaults. Its guide's other advice for throughput,
dynamic request batching (`--rayserve-batch`), made it slower on this workload, and Serve's
Python proxy in HAProxy's place (`--rayserve-proxy python`, which routes by multiplexed model)
made it about 3x slower (`rayserve_configs.py` compares the peer's configurations). A
comparison is only fair against the peer at its best.

Each round also runs the *in-process limit* of the same workload: the same router, cache policy
and total cache capacity, and forward, in one Python thread with no HTTP and no Ray. momlp's
ratio to it says how much of its own work's speed the serving stack delivers.

Each line also splits the CPU time of the measured requests per row into the serving side (a
system's processes: server or proxy, Ray, actors or replicas) and the client (this process):
once the benchmark saturates the machine's cores, CPU per row is what bounds rows/s.

Prints one JSON line per system and round, one per system with the medians over rounds, and
one with the ratios and the arithmetic behind the rows/s ratio (cores busy over CPU per row:
`ratio_arithmetic`). Binds and sends only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
# Imported as `benchmarks.vs_ray_serve` (by its tests), the modules beside it are found here
# too; run as a script, this folder is already first on sys.path.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _serve_driver import (  # noqa: E402
    KEPT,
    CpuMeter,
    Post,
    Record,
    client_errors,
    drive,
    frozen_heap,
    http_client,
    parse_momlp,
    parse_rayserve,
    run_driver,
    summarize,
)
from _serve_systems import (  # noqa: E402
    MOMLP_ENV,
    RAYSERVE_BEST,
    add_rayserve_args,
    add_rayserve_proxy_arg,
    free_port,
    momlp_command,
    peer_max_ongoing,
    run_inprocess,
    run_momlp,
    run_rayserve,
    served,
    wait_ready,
)
from _serve_workload import (  # noqa: E402
    ISSUE_WORKLOAD,
    add_workload_args,
    build_store,
    make_workload,
    open_or_build,
    prepare,
)

# The script's own names, and the serving benchmarks' shared ones it has always offered
# (`serve_ab.py`, `http_floor.py`, `rayserve_configs.py`, ... import them from here).
__all__ = [
    "HERE",
    "ISSUE_WORKLOAD",
    "KEPT",
    "MACHINE",
    "MOMLP_ENV",
    "RAYSERVE_BEST",
    "CpuMeter",
    "Post",
    "Record",
    "add_rayserve_args",
    "add_rayserve_proxy_arg",
    "add_workload_args",
    "build_store",
    "client_errors",
    "cpu_facts",
    "drive",
    "free_port",
    "frozen_heap",
    "http_client",
    "main",
    "make_workload",
    "momlp_command",
    "open_or_build",
    "parse_momlp",
    "parse_rayserve",
    "peer_max_ongoing",
    "prepare",
    "ratio_arithmetic",
    "run_driver",
    "run_inprocess",
    "run_momlp",
    "run_rayserve",
    "served",
    "summarize",
    "wait_ready",
]

MACHINE = os.environ.get("MOMLP_BENCH_MACHINE", "2-core x86-64 VM, no GPU, shared with other work")


def cpu_facts() -> str:
    """The host's CPU model and cache sizes, as this VM reports them.

    The development VM has run on more than one kind of host, and the ratios moved with it
    (RESULTS.md, thirty-fourth session), so every record says which host it ran on.
    """
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            caches.append(f"L{level} {size}")
    return ", ".join([model, *caches])


def ratio_arithmetic(
    momlp: dict[str, float], peer: dict[str, float], limit: dict[str, float], goal: float = 3.0
) -> dict[str, float]:
    """Why the rows/s ratio is what it is, from each system's median line.

    rows/s = cores busy / CPU per row (the client's CPU counted), so momlp's ratio to the peer
    is (cores busy, momlp / peer) / (CPU per row, momlp / peer) to within the error of the
    medians. The last two fields compare momlp's serving CPU per row with the in-process
    limit's: what it spent, and what `goal` times the peer's rows/s would allow it at the
    cores it keeps busy (RESULTS.md, "Where issue 19 stands").
    """
    cores = momlp["cpu_cores_busy"] / peer["cpu_cores_busy"]
    momlp_row = momlp["cpu_ms_per_row_serving"] + momlp["cpu_ms_per_row_client"]
    peer_row = peer["cpu_ms_per_row_serving"] + peer["cpu_ms_per_row_client"]
    allowed_row = 1000.0 * momlp["cpu_cores_busy"] / (goal * peer["rows_per_s"])
    return {
        "cores_busy_ratio": cores,
        "cpu_per_row_ratio_with_client": momlp_row / peer_row,
        "rows_per_s_ratio_predicted": cores / (momlp_row / peer_row),
        "serving_cpu_per_row_to_limit": momlp["cpu_ms_per_row_serving"]
        / limit["cpu_ms_per_row_serving"],
        f"serving_cpu_per_row_to_limit_for_{goal:g}x": (
            allowed_row - momlp["cpu_ms_per_row_client"]
        )
        / limit["cpu_ms_per_row_serving"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="load generator's HTTP client: aiohttp (C parser, ~0.1 ms CPU a request) or "
        "httpx (~1.4 ms; what runs before 2026-11-23's fifth session used)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rayserve-config",
        choices=("best", "default"),
        default="best",
        help="Ray Serve's documented high-throughput settings (best) or its defaults",
    )
    add_rayserve_args(parser)
    parser.add_argument(
        "--quick", action="store_true", help="about a minute: 1 round of 600 requests"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.warmup = 1, 600, 100
    store, widths, expert_bytes, work = prepare(args)
    setup = {
        "experts": store.manifest.num_experts,
        "widths": list(widths),
        "expert_bytes": expert_bytes,
        "actors": args.actors,
        "budget_bytes_per_actor": args.budget,
        "experts_per_actor": args.experts_per_actor,
        "requests": args.requests,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "client": args.client,
        "batch": args.rows_per_request,
        "distribution": "zipf:1.0",
        "rayserve_config": args.rayserve_config,
        "rayserve_max_ongoing": peer_max_ongoing(args),
        "rayserve_proxy": args.rayserve_proxy,
        "rayserve_batch": args.rayserve_batch,
        "rayserve_batch_wait_ms": args.rayserve_batch_wait_ms,
        "machine": MACHINE,
        "cpu": cpu_facts(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    runners = {"momlp": run_momlp, "ray_serve": run_rayserve, "in_process": run_inprocess}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    outputs: dict[str, list[Any]] = {}
    for round_ in range(args.rounds):
        # The two servers alternate who goes first; the in-process limit runs last.
        servers = ["momlp", "ray_serve"] if round_ % 2 == 0 else ["ray_serve", "momlp"]
        order = [*servers, "in_process"]
        for system in order:
            records, seconds, cpu = runners[system](args, store, work, round_)
            line = summarize(
                system,
                records,
                args.warmup,
                seconds,
                round_,
                rows_per_request=args.rows_per_request,
                cpu=cpu,
            )
            line |= setup
            results[system].append(line)
            outputs.setdefault(system, [r.outputs for r in records[:32]])
            print(json.dumps(line), flush=True)
    medians: dict[str, dict[str, Any]] = {}
    for system, lines in results.items():
        keys = (
            "rows_per_s",
            "p50_ms",
            "p99_ms",
            "hit_rate",
            "peak_resident_bytes",
            "cpu_ms_per_row_serving",
            "cpu_ms_per_row_client",
            "cpu_cores_busy",
        )
        medians[system] = {
            key: statistics.median(v for v in (line[key] for line in lines) if v is not None)
            for key in keys
        }
        head = {"benchmark": "vs_ray_serve", "system": system, "stat": "median"}
        line = head | {"rounds": args.rounds} | medians[system] | setup
        print(json.dumps(line), flush=True)
    same = all(
        a is not None
        and b is not None
        and c is not None
        and np.allclose(a, b, rtol=1e-4, atol=1e-5)
        and np.allclose(a, c, rtol=1e-4, atol=1e-5)
        for a, b, c in zip(
            outputs["momlp"], outputs["ray_serve"], outputs["in_process"], strict=True
        )
    )
    m, r, limit = medians["momlp"], medians["ray_serve"], medians["in_process"]
    comparison = {
        "benchmark": "vs_ray_serve",
        "stat": "ratio momlp / ray_serve (medians)",
        "rows_per_s_ratio": m["rows_per_s"] / r["rows_per_s"],
        "p99_ratio": m["p99_ms"] / r["p99_ms"],
        # Paired within a round (same machine load), then the median over rounds.
        "rows_per_s_ratio_paired": statistics.median(
            a["rows_per_s"] / b["rows_per_s"]
            for a, b in zip(results["momlp"], results["ray_serve"], strict=True)
        ),
        "p99_ratio_paired": statistics.median(
            a["p99_ms"] / b["p99_ms"]
            for a, b in zip(results["momlp"], results["ray_serve"], strict=True)
        ),
        "rows_per_s_ratio_to_in_process_limit": m["rows_per_s"] / limit["rows_per_s"],
        "rows_per_s_ratio_to_limit_paired": statistics.median(
            a["rows_per_s"] / b["rows_per_s"]
            for a, b in zip(results["momlp"], results["in_process"], strict=True)
        ),
        # Serving-side CPU per row: what bounds rows/s once the cores are saturated.
        "cpu_per_row_serving_ratio": m["cpu_ms_per_row_serving"] / r["cpu_ms_per_row_serving"],
        **ratio_arithmetic(m, r, limit),
        "goal_half_of_limit": m["rows_per_s"] >= 0.5 * limit["rows_per_s"],
        "goal_rows_per_s_3x": m["rows_per_s"] >= 3 * r["rows_per_s"],
        "goal_p99_half": m["p99_ms"] <= 0.5 * r["p99_ms"],
        "same_outputs_first_32": same,
    }
    print(json.dumps(comparison | setup), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
