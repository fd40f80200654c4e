"""`momlp build`: argparse registration (stdlib only at import time) and its handler."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]

# Repeated here rather than imported: this module must not import numpy/torch at load time.
_DATASETS = ("holder1d", "ackley2d", "ackley3d", "rastrigin2d", "rastrigin3d", "digits",
             "tree8", "tree16")  # tree8/tree16: --kind graph only


def register(subparsers: Any) -> None:
    """Add `momlp build` to the root parser's subparsers."""
    p = subparsers.add_parser(
        "build",
        help="train a mixture of expert MLPs and publish it as a store",
        description=(
            "Discover prototypes, build the routing tree, train one expert per leaf as Ray "
            "tasks (Algorithm 2 of the paper), evaluate against the wide-MLP baseline and "
            "publish the store (manifest.json written last)."
        ),
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", choices=_DATASETS, help="a built-in dataset")
    source.add_argument("--data", type=Path, metavar="FILE", help=".npz (X, y), .csv or .parquet")
    p.add_argument("--target", metavar="COLUMN", help="target column of a .csv/.parquet table")
    p.add_argument("--task", choices=("auto", "regression", "classification"), default=None)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="store directory")
    p.add_argument("--experts", type=int, default=None, metavar="K", help="number of experts")
    p.add_argument("--branching", type=int, default=None, metavar="NU", help="tree branching ν")
    p.add_argument("--routing", choices=("tree", "exact"), default=None)
    p.add_argument("--temperature", type=float, default=None, help="τ of the top-k gate")
    p.add_argument("--prototypes", choices=("kmeans", "learned"), default=None)
    p.add_argument("--width", type=int, default=None, help="hidden width of each expert")
    p.add_argument("--depth", type=int, default=None, help="hidden layers after deepening")
    p.add_argument("--initial-depth", type=int, default=None, help="hidden layers before")
    p.add_argument("--prototype-epochs", type=int, default=None)
    p.add_argument("--warmup-epochs", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None, help="per-expert epochs after deepening")
    p.add_argument("--baseline-epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--prototype-lr", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--loss", choices=("auto", "mse", "ce", "weighted-ce"), default=None)
    p.add_argument("--noise-std", type=float, default=None)
    p.add_argument("--no-baseline", dest="baseline", action="store_false", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--grid-size", type=int, default=None, help="grid points per axis")
    p.add_argument("--hurst", type=float, default=None, help="α of the holder1d path")
    p.add_argument("--test-fraction", type=float, default=None)
    p.add_argument(
        "--executor", choices=("ray", "local"), default=None,
        help="ray (default): one Ray task per expert; local: train them one by one in this "
        "process, without Ray",
    )
    p.add_argument(
        "--ray-address", default=None,
        help="join this Ray cluster (tasks write expert files under --out: use shared storage)",
    )
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of an embedded Ray")
    p.add_argument("--max-retries", type=int, default=None)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="small preset for tests and the demo")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--kind", choices=("momlp", "graph"), default="momlp", help="store kind")
    p.add_argument("--graph", type=Path, metavar="SPEC", help="graph spec JSON (--kind graph)")
    p.add_argument("--graph-training", choices=("end-to-end", "nodewise"), default="end-to-end",
                   help="nodewise: the data has a target per node (.npz arrays t_<node>)")
    p.add_argument("--samples", type=int, default=None, help="rows of tree8/tree16")
    p.set_defaults(handler=_handle_build)


_CONFIG_OPTIONS = (
    "dataset", "data", "target", "task", "experts", "branching", "routing", "temperature",
    "prototypes", "width", "depth", "initial_depth", "prototype_epochs", "warmup_epochs",
    "epochs", "baseline_epochs", "lr", "prototype_lr", "batch_size", "loss", "noise_std",
    "baseline", "seed", "grid_size", "hurst", "test_fraction", "executor", "ray_address",
    "num_cpus", "max_retries", "torch_threads",
)


def _handle_build(args: argparse.Namespace) -> int:
    if args.kind == "graph":
        from trainer.graph._cli import handle_graph_build

        return handle_graph_build(args)
    if args.graph or args.graph_training != "end-to-end" or args.dataset in ("tree8", "tree16"):
        print("momlp build: --graph, --graph-training and tree8/tree16 need --kind graph",
              file=sys.stderr)
        return 2
    import torch

    from experts_store import Store
    from trainer import (
        BuildConfig,
        ConfigError,
        DataError,
        TrainerError,
        build_store,
        quick_overrides,
    )

    options: dict[str, Any] = quick_overrides(args.dataset) if args.quick else {}
    options.update({k: getattr(args, k) for k in _CONFIG_OPTIONS if getattr(args, k) is not None})
    try:
        config = BuildConfig(out=args.out, **options)
        if args.torch_threads is not None:
            torch.set_num_threads(args.torch_threads)
        manifest = build_store(config, progress=args.progress)
    except TrainerError as exc:
        print(f"momlp build: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, DataError | ConfigError) else 1
    report = Store.open(args.out).report() or {}
    summary = {
        "store": str(args.out),
        "store_version": manifest.store_version,
        "num_experts": manifest.num_experts,
        "mixture": report["mixture"],
        "baseline": None if report["baseline"] is None else {
            k: report["baseline"][k] for k in ("metric", "value", "params")
        },
        "total_s": round(report["timings"]["total_s"], 2),
    }
    print(json.dumps(summary))
    return 0
