"""What `momlp build` refuses before any training starts: an --out where no store can be
published, and options that the chosen kind or the data source would leave unread.

Standard library only, like `trainer._cli` (`momlp --help` imports it)."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

__all__ = ["CONFIG_OPTIONS", "ignored_options", "out_problem", "unread_by_source"]

# The `momlp build` options a momlp `BuildConfig` takes, by argparse dest.
CONFIG_OPTIONS = (
    "dataset", "data", "target", "task", "experts", "branching", "routing", "temperature",
    "prototypes", "width", "depth", "initial_depth", "prototype_epochs", "warmup_epochs",
    "epochs", "baseline_epochs", "lr", "prototype_lr", "batch_size", "loss", "noise_std",
    "select_epoch", "validation_fraction", "baseline", "seed", "grid_size", "hurst",
    "test_fraction", "executor", "ray_address", "num_cpus", "max_retries", "torch_threads",
    "expert_activation", "gate",
    "gate_temperature_schedule", "balanced_tree",
)


def out_problem(out: Path) -> str | None:
    """Why no store can be published at `out`, or None.

    Checked before any training: StoreWriter only creates the directory after the
    prototype phase, so a bad --out would otherwise cost that phase and end in a traceback.
    """
    existing = Path(os.path.abspath(out))
    missing: list[Path] = []
    while not os.path.exists(existing):
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        return "exists and is not a directory" if not missing else f"{existing} is not a directory"
    if not missing:
        if not os.access(existing, os.W_OK | os.X_OK):
            return "is not writable"
        return None
    return _creation_problem(missing[::-1])


def _creation_problem(chain: list[Path]) -> str | None:
    """Try to create `chain` (outermost first), then remove what was created.

    A trial, because permission bits cannot tell (root passes every access check, yet
    cannot create a directory under /proc or on a read-only mount).
    """
    created: list[Path] = []
    try:
        for directory in chain:
            try:
                os.mkdir(directory)
            except OSError as exc:
                return f"cannot create {directory}: {exc.strerror or exc}"
            created.append(directory)
    finally:
        # Leave no trace: a build that fails later on its data must not leave an empty store.
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
    return None

# The `momlp build` options each kind's build reads, by argparse dest (beyond --out, --kind,
# --quick and --no-progress). One given to a kind that would ignore it is refused, naming it:
# a silently ignored --gate or --executor let a user believe a store was built as asked.
_EVERY_KIND = {"dataset", "data", "seed"}
_KIND_READS = {
    "momlp": {*CONFIG_OPTIONS},
    "graph": {
        "batch_size", "epochs", "executor", "graph", "graph_finetune_epochs", "graph_training",
        "lr", "num_cpus", "prototype_epochs", "prototype_lr", "ray_address", "routing",
        "samples", "test_fraction", "torch_threads", "experts", "width", "branching",
    },
    "hyper": {
        "depth", "epochs", "lr", "batch_size", "kind_baseline", "named_conditions",
        "test_fraction", "condition_source", "width", "torch_threads",
    },
    "hyper-prototype": {
        "target", "task", "experts", "branching", "depth", "epochs", "lr", "batch_size",
        "grid_size", "test_fraction", "condition_source", "width", "torch_threads",
    },
    "pmoe": {
        "experts", "epochs", "lr", "batch_size", "width", "test_fraction", "patches_per_expert",
        "train", "kind_baseline", "patch_routing", "router_epochs", "num_train", "num_test",
        "patch_shape",
    },
}
_NOT_OPTIONS = {"out", "kind", "quick", "progress", "command", "handler", "log_level"}
# Options with a default other than None count as given only when set to something else.
_PARSER_DEFAULTS = {"condition_source": "request", "graph_training": "end-to-end"}
_FLAG_OF = {"baseline": "--no-baseline", "kind_baseline": "--baseline"}


def ignored_options(args: argparse.Namespace) -> str | None:
    """The refusal for options the chosen kind would ignore, or None."""
    kind = args.kind
    if kind == "hyper" and args.condition_source == "prototype":
        kind, where = "hyper-prototype", "--condition-source prototype"
    else:
        where = f"--kind {kind}"
    reads = _EVERY_KIND | _KIND_READS[kind]
    stray = [
        _FLAG_OF.get(name, "--" + name.replace("_", "-"))
        for name, value in vars(args).items()
        if name not in _NOT_OPTIONS and name not in reads and value is not None
        and value != _PARSER_DEFAULTS.get(name)
    ]
    if not stray:
        return None
    return f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to {where}"


# Options that size a built-in --dataset, which --data files would leave unread.
_DATASET_ONLY = {"samples": "--samples", "num_train": "--num-train", "num_test": "--num-test"}


def unread_by_source(args: argparse.Namespace) -> str | None:
    """The refusal for an option the data source leaves unread (the kind reads it from
    another source), or None."""
    files: list[Path] = args.data or []
    if files:
        given = [f for name, f in _DATASET_ONLY.items() if getattr(args, name, None) is not None]
        if given:
            verb = "sizes a built-in --dataset and does" if len(given) == 1 else (
                "size a built-in --dataset and do")
            return f"{', '.join(given)} {verb} not apply to --data"
    if args.target is not None and not any(
        f.suffix.lower() in (".csv", ".parquet") for f in files
    ):
        source = (
            "an .npz file (its y is the target)" if files
            else f"--dataset {args.dataset}" if args.dataset else "a built-in dataset"
        )
        return ("--target names a column of a .csv/.parquet --data table; it does not apply"
                f" to {source}")
    return None
