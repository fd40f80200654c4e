"""The handler of `momlp build --kind hyper` (registered by `trainer._cli`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

__all__ = ["handle_hyper_build"]

# `momlp build` options that mean something for a hypernetwork store, by config field.
_OPTIONS = {
    "dataset": "dataset", "data": "data", "depth": "depth", "epochs": "epochs", "lr": "lr",
    "batch_size": "batch_size", "seed": "seed", "hyper_baseline": "baseline",
    "named_conditions": "named_conditions", "test_fraction": "test_fraction",
}
_IGNORED = ("experts", "branching", "routing", "temperature", "prototypes", "target")
# `momlp build` options that `--condition-source prototype` reads (PrototypeBuildConfig fields),
# and those of the request path it has no use for (attribute -> the flag a user typed).
_PROTOTYPE_OPTIONS = (
    "dataset", "data", "target", "task", "experts", "branching", "depth", "epochs", "lr",
    "batch_size", "seed", "grid_size", "test_fraction",
)
_PROTOTYPE_IGNORED = {
    "named_conditions": "--named-conditions", "hyper_baseline": "--baseline",
    "routing": "--routing", "temperature": "--temperature", "prototypes": "--prototypes",
}


def handle_hyper_build(args: argparse.Namespace) -> int:
    import torch

    from trainer._summary import own_report

    from ._exceptions import HyperError
    from ._publish import HyperBuildConfig, build_hyper_store

    if args.condition_source == "prototype":
        return _prototype_build(args)
    for name in _IGNORED:
        if getattr(args, name, None) is not None:
            print(f"momlp build: --{name.replace('_', '-')} does not apply to --kind hyper",
                  file=sys.stderr)
            return 2
    options: dict[str, Any] = {
        field: getattr(args, arg) for arg, field in _OPTIONS.items()
        if getattr(args, arg, None) is not None
    }
    if args.quick:
        options.setdefault("epochs", 2)
    if args.width is not None:
        options["hidden"] = (args.width,)
    try:
        if args.torch_threads is not None:
            torch.set_num_threads(args.torch_threads)
        config = HyperBuildConfig(out=args.out, **options)
        manifest = build_hyper_store(config, progress=args.progress)
    except HyperError as exc:
        print(f"momlp build: {exc}", file=sys.stderr)
        return 2
    report = own_report(args.out, manifest.store_version) or {}
    keep = ("metric", "value", "params")
    hyper = manifest.hyper
    assert hyper is not None
    print(json.dumps({
        "store": str(args.out),
        "store_version": manifest.store_version,
        "kind": "hyper",
        "hypernetwork": {k: _finite(report["hypernetwork"][k]) for k in keep}
        if report else None,
        "theta_params": hyper.theta_size,
        "baseline": None if report.get("baseline") is None
        else {k: _finite(report["baseline"][k]) for k in keep},
        "named_conditions": hyper.conditions.count if hyper.conditions else 0,
        "total_s": round(report["timings"]["total_s"], 2) if report else None,
    }))
    return 0


def _finite(value: Any) -> Any:
    """`value`, or None for a NaN or infinite float (a diverged run): JSON has neither."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _prototype_build(args: argparse.Namespace) -> int:
    import torch

    from router import RouterError

    from ._exceptions import HyperError
    from ._prototype import PrototypeBuildConfig, build_prototype_store

    for name, flag in _PROTOTYPE_IGNORED.items():
        if getattr(args, name, None) is not None:
            print(f"momlp build: {flag} does not apply to --condition-source prototype",
                  file=sys.stderr)
            return 2
    options: dict[str, Any] = {
        name: getattr(args, name) for name in _PROTOTYPE_OPTIONS
        if getattr(args, name, None) is not None
    }
    if args.quick:
        options.setdefault("epochs", 2)
    if args.width is not None:
        options["hidden"] = (args.width,)
    try:
        if args.torch_threads is not None:
            torch.set_num_threads(args.torch_threads)
        manifest = build_prototype_store(
            PrototypeBuildConfig(out=args.out, **options), progress=args.progress
        )
    except (HyperError, RouterError) as exc:  # RouterError: inputs the router cannot take
        print(f"momlp build: {exc}", file=sys.stderr)
        return 2
    hyper = manifest.hyper
    assert hyper is not None and hyper.conditions is not None
    print(json.dumps({
        "store": str(args.out), "store_version": manifest.store_version, "kind": "hyper",
        "condition_source": "prototype", "experts": hyper.conditions.count,
        "theta_params": hyper.theta_size, "store_bytes": hyper.hypernetwork.bytes
        + hyper.conditions.bytes,
    }))
    return 0
