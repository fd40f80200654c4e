"""`momlp build`: argparse registration (stdlib only at import time) and its handler, which
refuses what `_build_checks` finds before any training; and the handler of `momlp store
calibrate`, which the CLI root passes to the store's command group."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainer._build_checks import CONFIG_OPTIONS, ignored_options, out_problem, unread_by_source

__all__ = ["handle_store_calibrate", "register"]

# Repeated here rather than imported: this module must not import numpy/torch at load time.
_DATASETS = ("holder1d", "ackley2d", "ackley3d", "rastrigin2d", "rastrigin3d", "digits")
_HYPER_DATASETS = ("hyper-synthetic", "rotate-digits")
_PMOE_DATASETS = ("digits-patches", "digits-patches-4class")  # trainer.pmoe.PMOE_DATASETS
_GRAPH_DATASETS = ("tree8", "tree16")  # --kind graph only


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
    source.add_argument(
        "--dataset", choices=_DATASETS + _GRAPH_DATASETS + _HYPER_DATASETS + _PMOE_DATASETS,
        help="a built-in dataset",
    )
    source.add_argument(
        "--data", type=Path, nargs="+", metavar="FILE",
        help=".npz (X, y), .csv or .parquet (with the tables extra); "
        "--kind hyper: .npz with X, I, y; --kind pmoe: two files X.npy y.npy",
    )
    p.add_argument("--target", metavar="COLUMN", help="target column of a .csv/.parquet table")
    p.add_argument(
        "--task", choices=("auto", "regression", "classification"), default=None,
        help="auto (default): classification when the target holds integers, booleans or text,"
        " else regression",
    )
    p.add_argument("--out", type=_out_dir, required=True, metavar="DIR", help="store directory")
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
    p.add_argument(
        "--select-epoch", choices=("last", "best-validation"), default=None,
        help="last (default): keep each expert's last epoch, trained on all its rows; "
        "best-validation: hold --validation-fraction of its rows out and keep the epoch "
        "that scores best on them",
    )
    p.add_argument("--validation-fraction", type=float, default=None,
                   help="rows held out per expert with --select-epoch best-validation (0.1)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", default=None)
    p.add_argument("--seed", type=_non_negative_int, default=None)
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
    p.add_argument("--num-cpus", type=_positive_int, default=None, help="CPUs of an embedded Ray")
    p.add_argument(
        "--max-retries", type=int, default=None, metavar="N",
        help="tries again of an expert whose worker crashed or ran out of memory (default 3); "
        "a store it cannot write or weights that are not numbers fail the build at once",
    )
    p.add_argument("--torch-threads", type=_positive_int, default=None, metavar="N")
    p.add_argument(
        "--balanced-tree", action="store_true", default=None,
        help="build a balanced prototype tree: depth exactly ceil(log_nu K), so a tree-mode "
        "walk costs at most nu*ceil(log_nu K) distance evaluations (default: k-means tree)",
    )
    p.add_argument(
        "--expert-activation", choices=("prelu", "relu", "gelu", "tanh", "sigmoid"),
        default=None, help="hidden activation of the experts (default prelu, the paper's)",
    )
    p.add_argument(
        "--gate", choices=("prototype", "learned-linear"), default=None,
        help="prototype (default): eq. (39) prototypes; learned-linear: a linear softmax "
        "router trained with the experts at a set τ (--temperature, default 1), served "
        "exactly through the prototype tree by the linear lift (exact routing)",
    )
    p.add_argument(
        "--gate-temperature-schedule", type=_schedule, default=None, metavar="START:END",
        help="learned-linear only: τ geometric from START to END over the joint phase "
        "(never learned; the store serves END)",
    )
    p.add_argument("--quick", action="store_true", help="small preset for tests and the demo")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument(
        "--kind", choices=("momlp", "graph", "hyper", "pmoe"), default="momlp",
        help="momlp (default): prototype-tree mixture; graph: a DAG of small mixtures (paper "
        "004); hyper: a hypernetwork f generating a primary g per condition (paper 001); "
        "pmoe: patch-level routing (paper 003)",
    )
    p.add_argument(
        "--baseline", dest="kind_baseline", choices=("embedding", "cnn"), default=None,
        help="kind hyper: embedding (also train q(x, e(I)) and report it); kind pmoe: cnn",
    )
    hyper = p.add_argument_group("--kind hyper (see trainer.hyper.HyperBuildConfig)")
    hyper.add_argument("--condition-source", choices=("request", "prototype"), default="request",
                       help="request (requests name conditions) or prototype (expert k = "
                       "g(.; f(p_k)) for --experts K prototypes; a regression --dataset/--data)")
    hyper.add_argument("--named-conditions", type=int, default=None, metavar="N",
                       help="store the first N distinct test conditions as test-0..")
    pmoe = p.add_argument_group("--kind pmoe (see trainer.pmoe.PMoEBuildConfig)")
    pmoe.add_argument("--patches-per-expert", type=int, default=None, metavar="L")
    pmoe.add_argument("--train", choices=("separate", "joint"), default=None)
    pmoe.add_argument(
        "--patch-routing", choices=("expert_choice", "token_choice"), default=None,
        help="token_choice: each patch to its nearest prototype's expert",
    )
    pmoe.add_argument("--patch-shape", default=None, metavar="PHxPW", help="for image X.npy")
    pmoe.add_argument("--router-epochs", type=int, default=None)
    pmoe.add_argument("--num-train", type=int, default=None)
    pmoe.add_argument("--num-test", type=int, default=None)
    graph = p.add_argument_group("--kind graph (see trainer.graph)")
    graph.add_argument("--graph", type=Path, metavar="SPEC", help="graph spec JSON")
    graph.add_argument("--graph-training", choices=("end-to-end", "nodewise"),
                       default="end-to-end",
                       help="nodewise: the data has a target per node (.npz arrays t_<node>)")
    graph.add_argument("--samples", type=int, default=None, help="rows of tree8/tree16")
    graph.add_argument("--graph-finetune-epochs", type=int, default=None, metavar="N",
                       help="after training, fine-tune each node (rest frozen) for N epochs, "
                       "one Ray task per node (--executor); default 0: off")
    p.set_defaults(handler=_handle_build)


def _schedule(text: str) -> tuple[float, float]:
    parts = text.split(":")
    try:
        start, end = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END like 1.0:0.1, got {text!r}") from None
    return start, end


def _int_at_least(text: str, least: int, what: str) -> int:
    error = argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    try:
        value = int(text)
    except ValueError:
        raise error from None
    if value < least:
        raise error
    return value


def _positive_int(text: str) -> int:
    # torch.set_num_threads raises on 0 or less, and only after the build has started; a Ray
    # of 0 CPUs never runs a training task.
    return _int_at_least(text, 1, "a positive integer")


def _non_negative_int(text: str) -> int:
    # numpy and sklearn refuse a negative seed, with a traceback, once the build has started.
    return _int_at_least(text, 0, "an integer >= 0")


def _out_dir(text: str) -> Path:
    # Path("") is ".": an unset shell variable would publish into the working directory.
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    return Path(text)


_BASELINE_KIND = {"embedding": "hyper", "cnn": "pmoe"}


def _handle_build(args: argparse.Namespace) -> int:
    # One --baseline flag for the kinds that have one; each kind's handler reads its own.
    baseline = args.kind_baseline
    if baseline is not None and _BASELINE_KIND[baseline] != args.kind:
        print(f"momlp build: --baseline {baseline} applies to --kind {_BASELINE_KIND[baseline]}",
              file=sys.stderr)
        return 2
    problem = out_problem(args.out)
    if problem is not None:
        print(f"momlp build: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    ignored = ignored_options(args) or unread_by_source(args)
    if ignored is not None:
        print(f"momlp build: {ignored}", file=sys.stderr)
        return 2
    args.hyper_baseline = baseline if args.kind == "hyper" else None
    args.pmoe_baseline = baseline if args.kind == "pmoe" else None
    if args.kind == "pmoe":
        from trainer.pmoe import handle_pmoe_build

        return handle_pmoe_build(args)
    if args.data is not None:
        if len(args.data) != 1:
            print("momlp build: --data takes one file", file=sys.stderr)
            return 2
        args.data = args.data[0]
    if args.kind == "hyper":
        from trainer.hyper._cli import handle_hyper_build

        return handle_hyper_build(args)
    if args.kind == "graph":
        from trainer.graph._cli import handle_graph_build

        return handle_graph_build(args)
    if args.dataset in _GRAPH_DATASETS:
        print(f"momlp build: --dataset {args.dataset} needs --kind graph", file=sys.stderr)
        return 2
    import torch

    from router import RouterError
    from trainer import (
        BuildConfig,
        ConfigError,
        DataError,
        TrainerError,
        build_store,
        quick_overrides,
    )
    from trainer._summary import own_report

    options: dict[str, Any] = quick_overrides(args.dataset) if args.quick else {}
    options.update({k: getattr(args, k) for k in CONFIG_OPTIONS if getattr(args, k) is not None})
    try:
        config = BuildConfig(out=args.out, **options)
        if args.torch_threads is not None:
            torch.set_num_threads(args.torch_threads)
        manifest = build_store(config, progress=args.progress)
    except (TrainerError, RouterError) as exc:
        # RouterError: data the checks let through but the router cannot take (|x| > 1e15).
        print(f"momlp build: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, DataError | ConfigError) else 1
    report = own_report(args.out, manifest.store_version)
    summary = {
        "store": str(args.out),
        "store_version": manifest.store_version,
        "num_experts": manifest.num_experts,
        "mixture": report["mixture"] if report else None,
        "baseline": None if not report or report["baseline"] is None else {
            k: report["baseline"][k] for k in ("metric", "value", "params")
        },
        "total_s": round(report["timings"]["total_s"], 2) if report else None,
    }
    print(json.dumps(summary))
    return 0


def handle_store_calibrate(args: argparse.Namespace) -> int:
    """`momlp store calibrate STORE --data FILE [--target COLUMN] [--top-k K,K]`."""
    from experts_store import StoreError
    from router import RouterError

    try:
        top_ks = None if args.top_k is None else [int(k) for k in args.top_k.split(",")]
    except ValueError:
        print(f"error: --top-k takes integers like 2,3, got {args.top_k!r}", file=sys.stderr)
        return 2
    from trainer import TrainerError, calibrate_store

    try:
        manifest = calibrate_store(args.dir, args.data, top_ks=top_ks, target=args.target)
    except (StoreError, TrainerError, RouterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    gate = manifest.gate_spec
    c = gate.calibration or {}
    print(
        f"calibrated τ={gate.temperature:.6g} on {c.get('rows')} rows: loss top-1 "
        f"{c.get('loss_top1'):.6g}, top-k {c.get('loss_at_temperature')} "
        f"(at τ=1: {c.get('loss_at_1')}); published version {manifest.store_version}"
    )
    return 0
