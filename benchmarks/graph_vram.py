"""Device memory per request of a served graph store (seed 004, issue 16 item "VRAM").

For K_v in --experts: build a tree8 graph store (`momlp build --kind graph`, binary tree on
8 inputs, 7 nodes of 2 -> 8 -> 8 -> 1 experts), serve it (`momlp serve`, 2 actors, embedded
Ray on 2 CPUs), and run `momlp loadtest --eval` on fresh tree8 rows at each --batch. The
load test's per-request `vram_bytes` is, for a graph store, the sum over nodes of the
largest expert a request used at that node plus its share of that expert's activation peak
(server/batching/_types.py). Compared against

    bound    = sum over nodes of (the node's largest expert + activation_peak(widths, batch))
    resident = every expert of the store (what a dense/all-resident model holds)

One JSON line per (K_v, batch).

    python benchmarks/graph_vram.py --quick          # K_v = 4, 16; batch 1, 16; 300 requests
    python benchmarks/graph_vram.py                  # 1000 requests, full training
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
MOMLP = [str(Path(sys.executable).parent / "momlp")]
_URL = re.compile(r"momlp serving .* at (http://127\.0\.0\.1:\d+)")


def build(out: Path, experts: int, quick: bool) -> None:
    subprocess.run(
        [*MOMLP, "build", "--kind", "graph", "--dataset", "tree8", "--experts", str(experts),
         "--out", str(out), "--no-progress", "--samples", "2000" if quick else "4000",
         *(["--epochs", "15"] if quick else [])],
        check=True, stdout=subprocess.DEVNULL,
    )


def eval_file(path: Path, rows: int) -> None:
    import torch

    from trainer.graph import tree_target

    x = torch.rand(rows, 8, generator=torch.Generator().manual_seed(99)) * 2 - 1
    y, _ = tree_target(x)
    np.savez(path, x=x.numpy(), y=y.numpy())


class Served:
    """`momlp serve` in a child process; its URL once it logs it."""

    def __init__(self, store: Path, cwd: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        self.process = subprocess.Popen(
            [*MOMLP, "serve", "--store", str(store), "--port", "0", "--actors", "2",
             "--ray-num-cpus", "2", "--no-watch-store"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
        )
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(180) or self.url is None:
            self.stop()
            raise RuntimeError("momlp serve did not start")

    def _pump(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            match = _URL.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def activation_peak(widths: list[int], rows: int) -> int:
    from server.pool import activation_peak_bytes

    return int(activation_peak_bytes(widths, rows))


def distance_evals(url: str, data: Path) -> dict[str, Any]:
    """Distance evaluations of 500 eval rows: the most per row (all nodes) and per node."""
    with np.load(data) as arrays:
        rows = arrays["x"][:500].tolist()
    body = httpx.post(f"{url}/v1/predict", json={"inputs": rows, "return_stats": True},
                      timeout=60).json()
    per_node = body["stats"]["graph"]["node_distance_evals"]
    return {"row_max": max(body["stats"]["distance_evals"]),
            "node_max": {name: max(values) for name, values in per_node.items()}}


def run_point(url: str, data: Path, report: Path, batch: int, requests: int) -> dict[str, Any]:
    subprocess.run(
        [*MOMLP, "loadtest", "--url", url, "--requests", str(requests), "--concurrency", "8",
         "--batch", str(batch), "--eval", str(data), "--report", str(report), "--no-plots",
         "--quiet"],
        check=True, stdout=subprocess.DEVNULL,
    )
    result: dict[str, Any] = json.loads((report / "report.json").read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--experts", default="4,16", help="K_v per node, comma separated")
    parser.add_argument("--batch", default="1,16", help="rows per request, comma separated")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="keep stores and reports here")
    args = parser.parse_args(argv)
    requests = args.requests or (300 if args.quick else 1000)
    with tempfile.TemporaryDirectory() as tmp:
        base = args.out or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        data = base / "tree8_eval.npz"
        eval_file(data, 2000)
        for experts in (int(k) for k in args.experts.split(",")):
            store = base / f"graph-k{experts}"
            started = time.perf_counter()
            build(store, experts, args.quick)
            build_s = time.perf_counter() - started
            served = Served(store, base)
            try:
                assert served.url is not None
                graph = httpx.get(f"{served.url}/v1/graph", timeout=30).json()
                widths = json.loads((store / "manifest.json").read_text())["experts"][0]["arch"]
                evals = distance_evals(served.url, data)
                bound_evals = sum(n["branching"] * math.ceil(math.log(n["num_experts"],
                                                                      n["branching"]) - 1e-9)
                                  for n in graph["nodes"])
                for batch in (int(b) for b in args.batch.split(",")):
                    report = run_point(served.url, data, base / f"report-k{experts}-b{batch}",
                                       batch, requests)
                    activations = len(graph["nodes"]) * activation_peak(widths["widths"], batch)
                    one_each = graph["one_expert_per_node_device_bytes"]
                    resident = graph["total_expert_device_bytes"]
                    bound = one_each + activations
                    p99 = report["vram_bytes"]["p99"]
                    print(json.dumps({
                        "bench": "graph_vram", "nodes": len(graph["nodes"]),
                        "experts_per_node": experts, "num_experts": sum(
                            n["num_experts"] for n in graph["nodes"]),
                        "batch": batch, "requests": report["requests"], "ok": report["ok"],
                        "vram_p50": report["vram_bytes"]["p50"], "vram_p99": p99,
                        "vram_max": report["vram_bytes"]["max"],
                        "bound_one_expert_per_node_plus_activations": bound,
                        "one_expert_per_node_bytes": one_each,
                        "activation_bytes": activations,
                        "all_experts_resident_bytes": resident,
                        "all_experts_resident_plus_activations": resident + activations,
                        "p99_over_bound": round(p99 / bound, 4),
                        "p99_over_resident": round(p99 / resident, 4),
                        "expert_file_bytes": graph["total_expert_bytes"],
                        "mse": (report.get("accuracy") or {}).get("value"),
                        "rows_per_s": round(report["rows_per_s"], 1),
                        "latency_p50_ms": round(report["latency_ms"]["p50"], 2),
                        "build_s": round(build_s, 1),
                        "distance_evals_row_max": evals["row_max"],
                        "distance_evals_node_max": evals["node_max"],
                        "distance_evals_bound_sum_nu_ceil_log": bound_evals,
                        "tree_walk_max": graph["max_distance_evals"],
                    }), flush=True)
            finally:
                served.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
