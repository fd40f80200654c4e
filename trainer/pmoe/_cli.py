"""The handler of `momlp build --kind pmoe` (its options are registered by `trainer._cli`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

from ._build import PMoEBuildConfig, build_pmoe
from ._exceptions import PMoEConfigError, PMoEError

__all__ = ["handle_pmoe_build"]

# Shared `momlp build` options that mean something for a pmoe build, by config field.
_SHARED = {
    "experts": "num_experts",
    "epochs": "epochs",
    "lr": "lr",
    "batch_size": "batch_size",
    "seed": "seed",
    "width": "hidden_total",
    "test_fraction": "test_fraction",
    "patches_per_expert": "patches_per_expert",
    "train": "train",
    "pmoe_baseline": "baseline",
    "patch_routing": "routing",
    "router_epochs": "router_epochs",
    "num_train": "num_train",
    "num_test": "num_test",
}
# `momlp build` options of the prototype-tree kind only; giving one with --kind pmoe is refused.
_MOMLP_ONLY = (
    "target", "task", "branching", "routing", "temperature", "prototypes", "depth",
    "initial_depth", "prototype_epochs", "warmup_epochs", "baseline_epochs", "prototype_lr",
    "loss", "noise_std", "baseline", "grid_size", "hurst", "executor", "ray_address",
    "num_cpus", "max_retries", "torch_threads",
)
# How `momlp build` spells each config field, so that an error names the flag the user gave.
_FLAGS = {
    **{field: "--" + k.removeprefix("pmoe_").replace("_", "-") for k, field in _SHARED.items()},
    "data": "--data", "dataset": "--dataset", "patch_shape": "--patch-shape",
}
_QUICK = {"num_train": 300, "num_test": 300, "epochs": 20, "router_epochs": 20}


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Config fields from the parsed flags; a momlp-only flag that was given is an error."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    stray = [k for k in _MOMLP_ONLY if k in given]
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        raise PMoEError(f"{flags} do not apply to --kind pmoe")
    options: dict[str, Any] = dict(_QUICK) if args.quick else {}
    options.update({field: given[k] for k, field in _SHARED.items() if k in given})
    if args.patch_shape is not None:
        try:
            ph, pw = (int(v) for v in str(args.patch_shape).lower().split("x"))
        except ValueError:
            raise PMoEError(f"--patch-shape takes PHxPW, got {args.patch_shape!r}") from None
        options["patch_shape"] = (ph, pw)
    if args.data is not None:
        if len(args.data) != 2:
            raise PMoEError("--kind pmoe takes --data X.npy y.npy")
        options["data"] = (args.data[0], args.data[1])
        options["dataset"] = None
    else:
        options["dataset"] = args.dataset
    known = {f.name for f in fields(PMoEBuildConfig)}
    assert set(options) <= known, set(options) - known
    return options


def handle_pmoe_build(args: argparse.Namespace) -> int:
    """Train and publish; prints a one-line JSON summary. Exit 2 on bad options, 1 otherwise."""
    try:
        config = PMoEBuildConfig(out=args.out, **_options(args))
        build = build_pmoe(config, progress=args.progress)
    except PMoEError as exc:
        if isinstance(exc, PMoEConfigError) and exc.option in _FLAGS:
            print(f"momlp build: {_FLAGS[exc.option]}: {exc.reason}", file=sys.stderr)
        else:
            print(f"momlp build: {exc}", file=sys.stderr)
        return 2
    m, report = build.manifest, build.report
    summary = {
        "store": str(args.out),
        "store_version": m.store_version,
        "kind": m.kind,
        "num_experts": m.num_experts,
        "accuracy": report["expert_choice_accuracy"],
        "token_choice_accuracy": report.get("token_choice_accuracy"),
        "baseline": report["baseline"],
        "total_s": round(report["total_s"], 2),
    }
    print(json.dumps(summary))
    return 0
