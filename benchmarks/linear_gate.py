"""Learned linear gates through the prototype tree (the linear lift), and expert activations.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/linear_gate.py [--quick]
        [--part lift|activations|all] [--seed N ...]

lift: linear routers of K experts on n = 16 inputs, lifted (router/_lift.py) into a
PrototypeTree; 10,000 queries; exact top-1 and top-4 of the tree on lifted rows against the
float64 brute-force argmax / top-4 of the logits, the largest gap between the served top-4
weights and the softmax of the top-4 logits, and distance evaluations per query (exact and
tree walk), beside the same figures for the plain prototype tree on the same points. Two
routers: "voronoi" (wᵢ = 2pᵢ, bᵢ = −‖pᵢ‖², the logits of the sqdist prototype gate, on the
clustered data of benchmarks/routing.py: K/100 centres in [0,1]^16, noise 0.02) and "random"
(wᵢ, bᵢ ~ N(0, 1), queries N(0, 1)). K ∈ {10³, 10⁴, 10⁵} (quick: 10³, 10⁴).
activations: quick stores (`momlp build --quick`, local executor, no baseline; seeds 0-2) on
Ackley-2D (K=16, ν=4) and digits (K=16, ν=4) with prelu, gelu and sigmoid experts, and on
Ackley-2D with exact routing, with the learned-linear gate (τ 1 → 0.25) in exact and tree
routing, and learned-linear with gelu experts: the build's test metric (held-out split).
Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from routing import make_data

from router import Gate, LinearGateRouter, PrototypeTree, lift_rows, linear_lift
from trainer import BuildConfig, build_store, quick_overrides


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({**record, "machine": platform.machine()}), flush=True)


def routers(kind: str, k: int, n: int, queries: int, seed: int) -> tuple[Any, Any, Any]:
    """(weights [K, n], biases [K], queries [Q, n]) of one linear router."""
    if kind == "voronoi":
        p, x = make_data("clustered", k, n, queries, seed)
        w = 2.0 * p.astype(np.float64)
        b = -(p.astype(np.float64) ** 2).sum(axis=1)
        return w.astype(np.float32), b.astype(np.float32), x.astype(np.float32)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    return w, b, rng.standard_normal((queries, n)).astype(np.float32)


def lift_part(quick: bool) -> None:
    n, queries = 16, 10_000
    for kind in ("voronoi", "random"):
        for k in (1_000, 10_000) if quick else (1_000, 10_000, 100_000):
            w, b, x = routers(kind, k, n, queries, seed=0)
            start = time.perf_counter()
            tree = PrototypeTree.build(linear_lift(torch.as_tensor(w), torch.as_tensor(b)),
                                       branching=4, seed=0)
            build_s = time.perf_counter() - start
            xt = torch.as_tensor(x)
            logits = xt.double() @ torch.as_tensor(w).double().T + torch.as_tensor(b).double()
            top = torch.topk(logits, 4, dim=1)
            # τ: the median gap between the two best logits, so the top-4 weights are not flat.
            tau = float(torch.median(top.values[:, 0] - top.values[:, 1]))
            xl = lift_rows(xt)
            start = time.perf_counter()
            one = tree.gate(xl, Gate(top_k=1, mode="exact"))
            exact_s = time.perf_counter() - start
            four = tree.gate(xl, Gate(top_k=4, mode="exact", temperature=2 * tau))
            walk = tree.gate(xl, Gate(top_k=1, mode="tree"))
            want = torch.softmax(top.values / tau, dim=1)
            record: dict[str, Any] = {
                "part": "lift", "router": kind, "K": k, "n": n, "queries": queries,
                "build_s": round(build_s, 3), "exact_qps": round(queries / exact_s),
                "exact_top1_agree": float((one.experts[:, 0] == top.indices[:, 0]).double().mean()),
                "exact_top4_agree": float(
                    (four.experts == top.indices).all(dim=1).double().mean()
                ),
                "exact_top4_weight_max_err": float((four.weights - want).abs().max()),
                "exact_evals_per_query": float(one.distance_evals.double().mean()),
                "evals_fraction_of_K": float(one.distance_evals.double().mean()) / k,
                "tree_top1_agree": float((walk.experts[:, 0] == top.indices[:, 0]).double().mean()),
                "tree_evals_per_query": float(walk.distance_evals.double().mean()),
            }
            # The logit-bound search (router.LinearGateRouter), forced on: its evaluations.
            searcher = LinearGateRouter(tree, search="always")
            start = time.perf_counter()
            found = searcher.gate(xt, Gate(top_k=1, mode="exact"))
            record["search_s"] = round(time.perf_counter() - start, 3)
            four_s = searcher.gate(xt, Gate(top_k=4, mode="exact", temperature=2 * tau))
            record["search_top1_agree"] = float(
                (found.experts[:, 0] == top.indices[:, 0]).double().mean())
            record["search_top4_same_as_scan"] = bool(
                torch.equal(four_s.experts, four.experts)
                and torch.equal(four_s.weights, four.weights))
            record["search_evals_per_query"] = float(found.distance_evals.double().mean())
            record["search_top4_evals_per_query"] = float(four_s.distance_evals.double().mean())
            record["exact_s"] = round(exact_s, 3)
            if kind == "voronoi":
                # The same points as a plain prototype tree: what the lift costs the search.
                p, _ = make_data("clustered", k, n, queries, 0)
                plain = PrototypeTree.build(p, branching=4, seed=0)
                r = plain.gate(xt, Gate(top_k=1, mode="exact"))
                record["plain_exact_evals_per_query"] = float(r.distance_evals.double().mean())
                record["plain_agrees_with_lifted"] = float(
                    (r.experts[:, 0] == one.experts[:, 0]).double().mean()
                )
            emit(record)


def activations_part(work: Path, seeds: list[int]) -> None:
    cases: list[tuple[str, str, dict[str, Any]]] = [
        (dataset, act, {"expert_activation": act})
        for dataset in ("ackley2d", "digits")
        for act in ("prelu", "gelu", "sigmoid")
    ]
    schedule = {"gate": "learned-linear", "gate_temperature_schedule": (1.0, 0.25)}
    cases += [
        ("ackley2d", "prelu", {"routing": "exact"}),
        ("ackley2d", "prelu", {**schedule, "routing": "exact"}),
        ("ackley2d", "prelu", {**schedule, "routing": "tree"}),
        ("ackley2d", "gelu", {**schedule, "routing": "exact", "expert_activation": "gelu"}),
    ]
    for (dataset, act, options), seed in itertools.product(cases, seeds):
        out = work / f"{dataset}-{act}-{options.get('gate', 'prototype')}-{seed}"
        config = BuildConfig(
            out=out, dataset=dataset, experts=16, branching=4, executor="local",
            baseline=False, seed=seed, **{**quick_overrides(dataset), **options},
        )
        start = time.perf_counter()
        build_store(config, progress=False)
        report = json.loads((out / "report.json").read_text())
        emit({"part": "activations", "dataset": dataset, "activation": act,
              "gate": options.get("gate", "prototype"), "routing": config.routing,
              "seed": seed, "metric": report["mixture"]["metric"],
              "value": report["mixture"]["value"],
              "build_s": round(time.perf_counter() - start, 1),
              "tree_top1_agreement_train": (report["gate"].get("calibration") or {}).get(
                  "tree_top1_agreement_train")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, action="append", help="activations: seeds (0 1 2)")
    parser.add_argument("--part", choices=("lift", "activations", "all"), default="all")
    args = parser.parse_args()
    if args.part in ("lift", "all"):
        lift_part(args.quick)
    if args.part in ("activations", "all"):
        with tempfile.TemporaryDirectory(prefix="momlp-act-") as tmp:
            activations_part(Path(tmp), args.seed or [0, 1, 2])


if __name__ == "__main__":
    main()
