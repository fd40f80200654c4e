"""`momlp loadtest` beside locust on one real server, with the same seeded requests.

Starts `momlp serve` on loopback (on a store it builds, unless --store is given), writes the
request bodies `momlp loadtest --seed S` would send (the client's own workload builder, same
seed, same batch and distribution, drawn in the same order) to a file the locustfile replays,
warms the server's caches, then runs both tools closed-loop at the same concurrency in ABBA
order (`--rounds`). Each run is its own process; neither tool's figures are re-timed here:
momlp's come from its report.json, locust's from its own per-request `response_time`.

    nice -n 10 .venv/bin/python benchmarks/loadtest_vs_locust.py --quick

Prints one JSON line per run and one with the locust / momlp ratios: the ratio of the medians
over rounds, and the median of the ratios of the two runs of each round (back to back, so they
share the shared machine's load of the moment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from client import AsyncClient, Distribution, build_workload

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The installed `momlp` script, or the same CLI by module where the project is only on
# PYTHONPATH (benchmarks/gpu_session.sh on a bare GPU machine).
MOMLP = (
    [str(BIN / "momlp")] if (BIN / "momlp").exists() else [sys.executable, "-m", "server._cli"]
)
LOCUSTFILE = REPO / "benchmarks" / "locustfile.py"
# Tiny runs of each tool whose median start-up CPU is subtracted from a full run's.
TINY_RUNS = 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    parser.add_argument("--store", type=Path, help="store to serve (default: build a quick one)")
    parser.add_argument("--requests", type=int, help="requests per run (quick 1500, else 3000)")
    parser.add_argument("--rounds", type=int, help="runs of each tool (quick 4, else 8)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight / users")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--distribution", default="zipf:1.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--actors", type=int, default=2)
    args = parser.parse_args()
    # A background job ignores SIGINT; SIGTERM must still stop the server through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    requests = args.requests or (1500 if args.quick else 3000)
    rounds = args.rounds or (4 if args.quick else 8)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="momlp-vs-locust-") as tmp:
        work = Path(tmp)
        store = args.store or build_store(work / "store", env)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [*MOMLP, "serve", "--store", str(store), "--port", str(port),
             "--actors", str(args.actors), "--ray-num-cpus", str(args.actors)],
            env=env, stdout=subprocess.DEVNULL, stderr=(work / "serve.log").open("w"),
        )  # fmt: skip
        try:
            wait_ready(url, server)
            bodies = work / "bodies.jsonl"
            rows = asyncio.run(write_bodies(url, bodies, requests, args))
            expected_experts = asyncio.run(route_experts(url, rows))
            # Warm-up: every expert resident before either tool is timed.
            run_loadtest(url, work / "warmup", min(500, requests), args, env)
            results: dict[str, list[dict[str, Any]]] = {"momlp loadtest": [], "locust": []}
            for index in range(rounds):
                # ABBA: a drift of the shared machine falls on both tools alike.
                order = ("momlp loadtest", "locust")
                for tool in order if index % 2 == 0 else order[::-1]:
                    before = child_cpu_s()
                    if tool == "locust":
                        figures = run_locust(url, bodies, work / f"locust-{index}", args, env)
                    else:
                        report = run_loadtest(url, work / f"loadtest-{index}", requests, args, env)
                        figures = loadtest_figures(report)
                        figures["same_rows_as_locust"] = report["expert_rows"] == expected_experts
                    # The tool's whole process (start-up included), user + system.
                    figures["cpu_s"] = round(child_cpu_s() - before, 3)
                    results[tool].append(figures)
                    emit({"tool": tool, "round": index, **figures})
            emit(client_cpu(url, bodies, work, requests, args, env, results))
        finally:
            stop(server)
    emit(ratios(results, requests, rounds, args))
    return 0


def child_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def client_cpu(
    url: str,
    bodies: Path,
    work: Path,
    requests: int,
    args: argparse.Namespace,
    env: dict[str, str],
    results: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """CPU ms each tool's own process spends per request: (full run - tiny run) / difference.

    The tiny run pays the same start-up (imports, workload set-up) with almost no requests, so
    the difference is the per-request cost of the client, which on a 2-core machine is CPU the
    server does not get. One tiny run's CPU moved 0.33-0.58 s between runs, ±0.07 ms a request
    of 3,000: the median of `TINY_RUNS` is subtracted.
    """
    tiny = 50
    tiny_bodies = work / "bodies-tiny.jsonl"
    tiny_bodies.write_text("".join(bodies.read_text().splitlines(keepends=True)[:tiny]))
    line: dict[str, Any] = {
        "figure": "client CPU per request (ms)", "tiny_requests": tiny, "tiny_runs": TINY_RUNS,
    }
    for tool in ("momlp loadtest", "locust"):
        startups = []
        for attempt in range(TINY_RUNS):
            before = child_cpu_s()
            if tool == "locust":
                run_locust(url, tiny_bodies, work / f"locust-tiny-{attempt}", args, env)
            else:
                run_loadtest(url, work / f"loadtest-tiny-{attempt}", tiny, args, env)
            startups.append(child_cpu_s() - before)
        startup = statistics.median(startups)
        full = statistics.median(run["cpu_s"] for run in results[tool])
        name = tool.split()[-1]
        line[f"{name}_cpu_ms_per_request"] = round(1000 * (full - startup) / (requests - tiny), 3)
        line[f"{name}_startup_cpu_s"] = round(startup, 2)
        line[f"{name}_startup_cpu_s_range"] = [round(min(startups), 2), round(max(startups), 2)]
    return line


def build_store(out: Path, env: dict[str, str]) -> Path:
    subprocess.run(
        [*MOMLP, "build", "--dataset", "ackley2d", "--experts", "16", "--branching",
         "4", "--quick", "--executor", "local", "--no-baseline", "--no-progress",
         "--torch-threads", "1", "--out", str(out)],
        env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"momlp serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit("momlp serve was not ready in time")


async def write_bodies(
    url: str, path: Path, requests: int, args: argparse.Namespace
) -> list[list[list[float]]]:
    """The bodies `momlp loadtest` sends in closed loop: request i holds the i-th draw."""
    async with AsyncClient(url) as client:
        model = await client.model(include_prototypes=True)
        workload = await build_workload(
            client, model, distribution=Distribution.parse(args.distribution), seed=args.seed
        )
    rows = [workload.next_request(args.batch) for _ in range(requests)]
    with path.open("w") as stream:
        for batch in rows:
            body = {"inputs": batch, "top_k": 1, "mode": None, "return_stats": True}
            stream.write(json.dumps(body, separators=(",", ":")) + "\n")
    return rows


async def route_experts(url: str, requests: list[list[list[float]]]) -> dict[str, int]:
    """Rows per expert of the bodies: what momlp loadtest's report counts if it sent them."""
    counts: Counter[int] = Counter()
    flat = [row for batch in requests for row in batch]
    async with AsyncClient(url) as client:
        for start in range(0, len(flat), 1024):
            routing = await client.route(flat[start : start + 1024], top_k=1)
            counts.update(experts[0] for experts in routing.experts)
    return {str(expert): count for expert, count in sorted(counts.items())}


def run_loadtest(
    url: str, out: Path, requests: int, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    subprocess.run(
        [*MOMLP, "--log-level", "WARNING", "loadtest", "--url", url,
         "--requests", str(requests), "--concurrency", str(args.concurrency),
         "--batch", str(args.batch), "--distribution", args.distribution,
         "--seed", str(args.seed), "--quiet", "--no-plots", "--report", str(out)],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def loadtest_figures(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "ok": report["ok"],
        "errors": report["errors"],
        "duration_s": round(report["duration_s"], 3),
        "requests_per_s": round(report["requests_per_s"], 2),
        "p50_ms": round(report["latency_ms"]["p50"], 3),
        "p99_ms": round(report["latency_ms"]["p99"], 3),
    }


def run_locust(
    url: str, bodies: Path, out: Path, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    locust = shutil.which("locust", path=str(BIN)) or "locust"
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / "records.json"
    subprocess.run(
        [locust, "-f", str(LOCUSTFILE), "--headless", "--users", str(args.concurrency),
         "--spawn-rate", "1000", "--host", url, "--only-summary", "--loglevel", "WARNING",
         "--json-file", str(out / "stats"), "--run-time", "600s"],
        env={**env, "MOMLP_LOCUST_BODIES": str(bodies), "MOMLP_LOCUST_OUT": str(records_path)},
        check=False, stdout=subprocess.DEVNULL, stderr=(out / "locust.log").open("w"),
        timeout=900,
    )  # fmt: skip
    data = json.loads(records_path.read_text())
    records = data["records"]
    ok = [latency for _, latency, status in records if status == 200]
    duration = max(start + latency / 1000 for start, latency, _ in records) - min(
        start for start, _, _ in records
    )
    own = locust_own_summary(out / "stats.json")
    return {
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "duration_s": round(duration, 3),
        "requests_per_s": round(len(ok) / duration, 2),
        # numpy's default (linear) percentile: the one momlp's report computes.
        "p50_ms": round(float(np.percentile(ok, 50)), 3),
        "p99_ms": round(float(np.percentile(ok, 99)), 3),
        "locust_summary": own,
    }


def locust_own_summary(path: Path) -> dict[str, float] | None:
    """Locust's own figures from its --json-file: it keeps response times in a histogram
    rounded to 2 significant digits above 100 ms (integers below), so these are coarser."""
    if not path.is_file():
        return None
    stats = json.loads(path.read_text())
    if not stats:
        return None
    entry = stats[0]
    histogram = sorted((float(value), count) for value, count in entry["response_times"].items())
    total = sum(count for _, count in histogram)

    def rank(q: float) -> float:
        # The smallest recorded value with at least q of the requests at or below it.
        seen = 0
        for value, count in histogram:
            seen += count
            if seen >= q * total:
                return value
        return histogram[-1][0]

    elapsed = entry["last_request_timestamp"] - entry["start_time"]
    return {
        "requests_per_s": round(entry["num_requests"] / elapsed, 2) if elapsed > 0 else 0.0,
        "p50_ms": rank(0.50),
        "p99_ms": rank(0.99),
    }


def stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def ratios(
    results: dict[str, list[dict[str, Any]]], requests: int, rounds: int, args: argparse.Namespace
) -> dict[str, Any]:
    def median(tool: str, key: str) -> float:
        return float(statistics.median(run[key] for run in results[tool]))

    line: dict[str, Any] = {
        "figure": "locust / momlp loadtest",
        "requests": requests,
        "rounds": rounds,
        "concurrency": args.concurrency,
        "batch": args.batch,
        "distribution": args.distribution,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.python_version()}",
    }
    for key in ("requests_per_s", "p50_ms", "p99_ms"):
        momlp, locust = median("momlp loadtest", key), median("locust", key)
        line[f"momlp_{key}"] = momlp
        line[f"locust_{key}"] = locust
        line[f"ratio_{key}"] = round(locust / momlp, 3) if momlp else None
        pairs = [
            theirs[key] / ours[key]
            for ours, theirs in zip(results["momlp loadtest"], results["locust"], strict=True)
            if ours[key]
        ]
        line[f"round_ratio_{key}"] = round(statistics.median(pairs), 3) if pairs else None
    return line


def emit(line: dict[str, Any]) -> None:
    print(json.dumps({"bench": "loadtest_vs_locust", **line}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
