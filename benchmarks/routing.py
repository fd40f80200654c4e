"""Routing throughput and exactness: tree / exact modes against brute force, faiss and hnswlib.

Prints one JSON line per configuration (K prototypes, n dims, data kind): queries/s and
distance evaluations per query of `tree` and `exact` mode, of a torch matmul brute force,
of faiss IndexFlatL2 and of hnswlib (ef=32), and each one's agreement with the float64
brute force (BruteForceRouter). Everything runs on one thread. A `duplicated` store holds
every prototype twice (K/2 distinct ones, shuffled): every query then has a tied nearest
pair, and exact mode must still answer the lower index.

    .venv/bin/python benchmarks/routing.py            # K in 1e3..1e5, n in {2, 16, 128}, plus
                                                      # small stores in low dimension
    .venv/bin/python benchmarks/routing.py --quick    # a small subset, a few minutes
    .venv/bin/python benchmarks/routing.py --baseline DIR   # also time exact mode of the
        # `router` package under DIR (e.g. an older commit's, `git archive REV router`),
        # in the same interleaved rounds: before/after side by side
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from router import BruteForceRouter, PrototypeTree  # noqa: E402
from router._bruteforce import RowArgmin, score_buffer  # noqa: E402

Config = tuple[str, int, int, bool]  # data kind, K, n, duplicated


def make_data(
    kind: str, k: int, n: int, queries: int, seed: int, duplicated: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    if duplicated:
        half, x = make_data(kind, k // 2, n, queries, seed)
        order = np.random.default_rng(seed + 1).permutation(2 * len(half))
        return np.concatenate([half, half])[order], x
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.random((k, n)).astype(np.float32), rng.random((queries, n))
    centres = rng.random((max(10, k // 100), n))
    sigma = 0.02
    p = centres[rng.integers(0, len(centres), k)] + sigma * rng.standard_normal((k, n))
    x = centres[rng.integers(0, len(centres), queries)] + sigma * rng.standard_normal((queries, n))
    return p.astype(np.float32), x


def interleaved(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    budget_s: float,
    min_s: float = 1.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, tuple[float, Any]]:
    """Median time of each function by `clock`, run in rounds (one call of each per round)
    so that load from other work on the machine hits every method alike. Fast methods get
    more rounds (until min_s of samples, at most 5x repeats); a method stops repeating
    once it has used budget_s.

    Each round runs the methods in a new order (seeded): a method that always ran right
    after another one using the same data (exact mode after the tree walk on the same tree)
    found that data in the CPU caches, and a method after unrelated work did not.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    outs: dict[str, Any] = {}
    order = random.Random(0)
    names = list(fns)
    for round_no in range(5 * repeats):
        ran = False
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            spent = sum(times[name])
            if times[name] and (spent > budget_s or (round_no >= repeats and spent >= min_s)):
                continue
            ran = True
            t0 = clock()
            outs[name] = fn()
            times[name].append(clock() - t0)
        if not ran:
            break
    return {name: (statistics.median(times[name]), outs[name]) for name in fns}


def torch_brute_force(
    p: np.ndarray, two_level: bool = False
) -> Callable[[np.ndarray], torch.Tensor]:
    """The plain matmul scan: argmin of ‖p‖² − 2x·p in float32, blocked like the router.

    two_level uses the router's RowArgmin (and its +inf padding, and its score buffer whose
    row stride avoids cache-set aliasing) instead of torch's argmin, so the exact mode can
    be compared with a scan that has the same argmin and layout.
    """
    pt = torch.from_numpy(p)
    width = RowArgmin.padded(len(p)) if two_level else len(p)
    p_t = torch.zeros((p.shape[1], width))
    p_t[:, : len(p)] = pt.t()
    norm2 = torch.full((width,), float("inf"))
    norm2[: len(p)] = (pt * pt).sum(dim=1)
    argmin = RowArgmin(width) if two_level else None
    rows = max(1, (1 << 20) // width)

    def run(x: np.ndarray) -> torch.Tensor:
        xt = torch.from_numpy(x.astype(np.float32))
        out = torch.empty(len(x), dtype=torch.long)
        buffer = score_buffer(min(rows, len(x)), width, torch.float32) if two_level else None
        for lo in range(0, len(x), rows):
            xb = xt[lo : lo + rows]
            if buffer is None:
                scores = torch.addmm(norm2[None, :], xb, p_t, alpha=-2.0)
            else:
                scores = torch.addmm(
                    norm2[None, :], xb, p_t, alpha=-2.0, out=buffer[: xb.shape[0]]
                )
            best = scores.argmin(dim=1) if argmin is None else argmin(scores)[:, 0]
            out[lo : lo + rows] = best
        return out

    return run


def load_baseline(root: str) -> Any:
    """PrototypeTree of the `router` package under root, imported as `router_baseline`."""
    package = os.path.join(root, "router")
    spec = importlib.util.spec_from_file_location(
        "router_baseline", os.path.join(package, "__init__.py"),
        submodule_search_locations=[package],
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"no router package under {root}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["router_baseline"] = module
    spec.loader.exec_module(module)
    return module.PrototypeTree


def bench_config(
    config: Config,
    queries: int,
    repeats: int,
    seed: int,
    baseline: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    import faiss
    import hnswlib

    kind, k, n, duplicated = config
    p, x = make_data(kind, k, n, queries, seed, duplicated)
    row: dict[str, Any] = {
        "bench": "routing", "data": kind, "K": k, "n": n, "duplicated": duplicated,
        "queries": queries,
    }
    t0 = time.perf_counter()
    tree = PrototypeTree.build(p, branching=4, seed=0)
    row["build_s"] = round(time.perf_counter() - t0, 3)
    row["depth"] = tree.depth
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "router.safetensors")
        tree.save(path)
        t0 = time.perf_counter()
        PrototypeTree.load(path)
        row["load_s"] = round(time.perf_counter() - t0, 4)

    t0 = time.perf_counter()
    truth = BruteForceRouter(p).route(x).experts[:, 0].numpy()
    row["truth_float64_s"] = round(time.perf_counter() - t0, 3)

    index = faiss.IndexFlatL2(n)
    index.add(p)
    xq = np.ascontiguousarray(x, dtype=np.float32)
    t0 = time.perf_counter()
    hnsw = hnswlib.Index(space="l2", dim=n)
    hnsw.init_index(max_elements=k, M=16, ef_construction=100, random_seed=0)
    hnsw.set_num_threads(1)
    hnsw.add_items(p, np.arange(k))
    hnsw.set_ef(32)
    row["hnsw_build_s"] = round(time.perf_counter() - t0, 3)
    brute = torch_brute_force(p)
    brute_2l = torch_brute_force(p, two_level=True)
    for mode in ("tree", "exact"):
        tree.route(x[:64], mode=mode)  # warm the lazily built search state
    fns: dict[str, Callable[[], Any]] = {}
    if baseline is not None:
        old = baseline.build(p, branching=4, seed=0)
        old.route(x[:64], mode="exact")
        fns["exact_baseline"] = lambda: old.route(x, mode="exact")

    results = interleaved(
        fns | {
            "tree": lambda: tree.route(x, mode="tree"),
            "exact": lambda: tree.route(x, mode="exact"),
            "brute_torch": lambda: brute(x),
            "brute_torch_2level": lambda: brute_2l(x),
            "faiss_flat": lambda: index.search(xq, 1)[1][:, 0],
            "hnswlib_ef32": lambda: hnsw.knn_query(xq, k=1)[0][:, 0].astype(np.int64),
        },
        repeats,
        budget_s=30.0,
        clock=clock,
    )
    for name, (secs, out) in results.items():
        if name in ("tree", "exact", "exact_baseline"):
            experts = out.experts[:, 0].numpy()
            evals: float | None = float(out.distance_evals.double().mean())
        else:
            experts = out.numpy() if isinstance(out, torch.Tensor) else out
            evals = None if name == "hnswlib_ef32" else float(k)
        row[name] = {
            "qps": round(queries / secs, 1),
            "evals_per_query": None if evals is None else round(evals, 1),
            "agreement": round(float((experts == truth).mean()), 6),
        }

    row["tree_vs_faiss_flat"] = round(row["tree"]["qps"] / row["faiss_flat"]["qps"], 2)
    row["exact_vs_faiss_flat"] = round(row["exact"]["qps"] / row["faiss_flat"]["qps"], 2)
    row["exact_vs_brute_torch"] = round(row["exact"]["qps"] / row["brute_torch"]["qps"], 2)
    row["exact_vs_brute_torch_2level"] = round(
        row["exact"]["qps"] / row["brute_torch_2level"]["qps"], 2
    )
    if baseline is not None:
        row["baseline_exact_vs_brute_torch"] = round(
            row["exact_baseline"]["qps"] / row["brute_torch"]["qps"], 2
        )
    return row


def small_store_grid(kinds: tuple[str, ...], dims: tuple[int, ...]) -> list[Config]:
    """K = 1,000 in low dimension, with and without every prototype duplicated, and one
    duplicated store large enough (K = 10^4, n = 2) for the tree search."""
    grid = [(kind, 1000, n, dup) for kind in kinds for n in dims for dup in (False, True)]
    return grid + [(kind, 10000, 2, True) for kind in kinds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small subset, short run")
    parser.add_argument("--queries", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=None, help="one config: K,n,kind[,dup]")
    parser.add_argument("--small-only", action="store_true",
                        help="only the small-store configurations (K = 1,000, low n)")
    parser.add_argument("--baseline", default=None,
                        help="directory holding another version's router/ package")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time q/s by wall clock, or by this process's CPU time "
                        "(everything runs on one thread; CPU time leaves out the time "
                        "other work on a shared machine takes the core away)")
    args = parser.parse_args()

    import faiss

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    kinds = ("clustered", "uniform")
    grid: list[Config]
    if args.quick:
        grid = [(kind, k, n, False) for kind in kinds for k in (1000, 10000) for n in (2, 16)]
        small = small_store_grid(kinds, (2, 8))
        queries = args.queries or 2000
    else:
        grid = [(kind, k, n, False) for kind in kinds
                for k in (1000, 10000, 100000) for n in (2, 16, 128)]
        small = small_store_grid(kinds, (2, 4, 8, 16))
        queries = args.queries or 10000
    grid += [c for c in small if c not in grid]
    if args.small_only:
        grid = small
    if args.only:
        k_s, n_s, kind_s, *rest = args.only.split(",")
        grid = [(kind_s, int(k_s), int(n_s), rest == ["dup"])]
    baseline = load_baseline(args.baseline) if args.baseline else None
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": 1,
        "clock": args.clock,
    }
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for config in grid:
        _, k, n, _ = config
        row = bench_config(
            config, queries, args.repeats, seed=k + n, baseline=baseline, clock=clock
        )
        row.update(meta)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
