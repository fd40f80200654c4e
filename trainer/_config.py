"""`BuildConfig`: every option of `momlp build`, with the paper's defaults and a quick preset."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._datasets import DATASET_NAMES, DEFAULT_HURST, Task
from ._exceptions import ConfigError
from ._train import LossName

__all__ = [
    "QUICK_DEMO",
    "BuildConfig",
    "ResolvedTraining",
    "quick_demo_config",
    "quick_overrides",
]


@dataclass(frozen=True)
class BuildConfig:
    """Options of one build. None means "the paper's choice for this task" (see `resolve`)."""

    out: Path
    dataset: str | None = None  # one of DATASET_NAMES, or None with `data`
    data: Path | None = None  # .npz (X, y) / .csv / .parquet
    target: str | None = None  # target column of a table
    task: Literal["auto", "regression", "classification"] = "auto"
    experts: int = 16
    branching: int = 4
    routing: Literal["tree", "exact"] = "tree"
    # τ of the top-k gate softmax(−d²/τ); None: calibrated on the held-out split after training
    temperature: float | None = None
    prototypes: Literal["kmeans", "learned"] = "learned"
    width: int = 1000  # D.3.1
    depth: int | None = None  # hidden layers: 3 (regression) / 4 (classification), D.3.1
    initial_depth: int = 1  # hidden layers of the small networks before deepening
    prototype_epochs: int = 20  # epochs of the joint phase of eq. (39)
    warmup_epochs: int = 5  # small-network epochs per cell when prototypes come from k-means
    epochs: int = 100  # per-expert epochs after deepening
    # Default: epochs / K, rounded up, which gives the baseline the mixture's training FLOPs
    # (a step of the w·√K-wide baseline costs K steps of a width-w expert).
    baseline_epochs: int | None = None
    lr: float | None = None  # Adam 1e-4 (regression) / AdamW 1e-3 (classification)
    prototype_lr: float | None = None  # default: lr (one Adam over networks and prototypes)
    batch_size: int = 128
    loss: Literal["auto", "mse", "ce", "weighted-ce"] = "auto"
    noise_std: float = 1e-3  # of the near-identity layers added by deepening
    # Which weights a deepened expert (and the baseline) ends with. "last": the last epoch's,
    # trained on every row of its cell. "best-validation": `validation_fraction` of each
    # cell's training rows are held out, and the epoch whose weights score lowest on them
    # is kept (Section 6.1 splits 80 % "for training and validation").
    select_epoch: Literal["last", "best-validation"] = "last"
    validation_fraction: float = 0.1
    baseline: bool = True
    seed: int = 0
    grid_size: int | None = None  # points per axis of the synthetic grids (paper's s if None)
    hurst: float = DEFAULT_HURST  # α of the holder1d fBm path
    test_fraction: float = 0.2
    # "local" trains every job in this process, one after another, without Ray: for machines
    # without Ray (a GPU box with torch only) and for debugging a job.
    executor: Literal["ray", "local"] = "ray"
    ray_address: str | None = None
    num_cpus: int | None = None  # of an embedded Ray started by the build
    max_retries: int = 3
    torch_threads: int = 1
    quick: bool = False  # recorded in the report; set by the quick preset
    crash_once_expert: int | None = None  # test hook: kill the first attempt of this expert
    # Hidden activation of every expert (ExpertArch.activation); "prelu" is the paper's.
    expert_activation: Literal["prelu", "relu", "gelu", "tanh", "sigmoid"] = "prelu"
    # "prototype": eq. (39)'s prototypes (or k-means); "learned-linear": a linear softmax
    # router (logits wᵢᵀx + bᵢ) trained with the small networks at a set τ (`temperature`,
    # default 1, or the schedule), served exactly through the tree by the linear lift.
    gate: Literal["prototype", "learned-linear"] = "prototype"
    # (start, end): τ of the learned-linear router, geometric over the joint phase's epochs.
    gate_temperature_schedule: tuple[float, float] | None = None
    # Balanced prototype tree (router/_balanced.py): depth exactly ⌈log_ν K⌉, so a tree-mode
    # walk costs ≤ ν⌈log_ν K⌉ evaluations; cells are not Voronoi (off: the k-means tree).
    balanced_tree: bool = False

    def validate(self) -> None:
        """ConfigError naming the first option that cannot work."""
        if (self.dataset is None) == (self.data is None):
            raise ConfigError("give exactly one of --dataset NAME or --data FILE", option="dataset")
        if self.dataset is not None and self.dataset not in DATASET_NAMES:
            raise ConfigError(
                f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASET_NAMES)}",
                option="dataset",
            )
        positive = {
            "experts": self.experts,
            "width": self.width,
            "batch_size": self.batch_size,
            "initial_depth": self.initial_depth,
            "torch_threads": self.torch_threads,
        }
        for option, value in positive.items():
            if value < 1:
                raise ConfigError(f"must be at least 1, got {value}", option=option)
        if self.branching < 2:
            raise ConfigError(f"must be at least 2, got {self.branching}", option="branching")
        if self.depth is not None and self.depth < self.initial_depth:
            raise ConfigError(
                f"must be at least --initial-depth ({self.initial_depth}), got {self.depth}",
                option="depth",
            )
        for option in ("prototype_epochs", "warmup_epochs", "epochs", "baseline_epochs",
                       "max_retries", "seed"):
            value = getattr(self, option)
            if value is not None and value < 0:
                raise ConfigError(f"must not be negative, got {value}", option=option)
        if self.num_cpus is not None and self.num_cpus < 1:
            # Each training task asks Ray for one CPU: with none, they would wait for ever.
            raise ConfigError(f"must be at least 1, got {self.num_cpus}", option="num_cpus")
        if self.expert_activation not in ("prelu", "relu", "gelu", "tanh", "sigmoid"):
            raise ConfigError(
                f"unknown activation {self.expert_activation!r}", option="expert_activation"
            )
        if self.gate not in ("prototype", "learned-linear"):
            raise ConfigError(f"unknown gate {self.gate!r}", option="gate")
        schedule = self.gate_temperature_schedule
        if schedule is not None:
            if self.gate != "learned-linear":
                raise ConfigError("only --gate learned-linear has a temperature schedule",
                                  option="gate_temperature_schedule")
            if self.temperature is not None:
                raise ConfigError("give --temperature (fixed τ) or the schedule, not both",
                                  option="gate_temperature_schedule")
            if len(schedule) != 2 or not all(math.isfinite(t) and t > 0 for t in schedule):
                raise ConfigError(f"needs two positive numbers START:END, got {schedule}",
                                  option="gate_temperature_schedule")
        if self.gate == "learned-linear" and self.prototypes != "learned":
            raise ConfigError("--gate learned-linear trains its own router; --prototypes "
                              f"{self.prototypes} does not apply", option="prototypes")
        for option in ("lr", "prototype_lr", "temperature"):
            value = getattr(self, option)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"must be a positive number, got {value}", option=option)
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError("must lie in (0, 1)", option="test_fraction")
        if not 0.0 < self.hurst < 1.0:
            raise ConfigError("must lie in (0, 1)", option="hurst")
        if not (math.isfinite(self.noise_std) and self.noise_std >= 0):
            raise ConfigError(f"must be a finite number >= 0, got {self.noise_std}",
                              option="noise_std")
        if self.select_epoch not in ("last", "best-validation"):
            raise ConfigError(f"must be last or best-validation, got {self.select_epoch!r}",
                              option="select_epoch")
        if not 0.0 < self.validation_fraction < 1.0:
            raise ConfigError("must lie in (0, 1)", option="validation_fraction")
        if self.crash_once_expert is not None and not 0 <= self.crash_once_expert < self.experts:
            raise ConfigError("must name an expert id", option="crash_once_expert")
        if self.executor not in ("ray", "local"):
            raise ConfigError(f"must be ray or local, got {self.executor!r}", option="executor")
        if self.executor == "local":
            for option in ("ray_address", "num_cpus", "crash_once_expert"):
                if getattr(self, option) is not None:
                    raise ConfigError("only with --executor ray", option=option)

    def resolve(self, task: Task) -> ResolvedTraining:
        """The task-dependent choices of D.3.1 where the config leaves them open."""
        classification = task == "classification"
        if classification and self.loss == "mse":
            raise ConfigError("classification trains with ce or weighted-ce", option="loss")
        if not classification and self.loss in ("ce", "weighted-ce"):
            raise ConfigError("regression trains with mse", option="loss")
        loss: LossName = ("ce" if classification else "mse") if self.loss == "auto" else self.loss
        depth = self.depth if self.depth is not None else (4 if classification else 3)
        if depth < self.initial_depth:
            raise ConfigError(
                f"depth {depth} is below --initial-depth {self.initial_depth}", option="depth"
            )
        lr = self.lr if self.lr is not None else (1e-3 if classification else 1e-4)
        return ResolvedTraining(
            task=task,
            loss=loss,
            depth=depth,
            lr=lr,
            optimizer="adamw" if classification else "adam",
            batchnorm=classification,
            baseline_epochs=(
                self.baseline_epochs
                if self.baseline_epochs is not None
                else math.ceil(self.epochs / self.experts)
            ),
            prototype_lr=self.prototype_lr if self.prototype_lr is not None else lr,
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The options as JSON-safe values (recorded in report.json)."""
        return {
            f.name: (str(v) if isinstance(v, Path) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }


@dataclass(frozen=True)
class ResolvedTraining:
    task: Task
    loss: LossName
    depth: int
    lr: float
    optimizer: Literal["adam", "adamw"]
    batchnorm: bool
    baseline_epochs: int
    prototype_lr: float


# Grid points per axis for quick runs: ~2,000 samples whatever the dimension.
_QUICK_GRID = {
    "holder1d": 2000, "ackley2d": 40, "rastrigin2d": 40, "ackley3d": 12, "rastrigin3d": 12
}


def quick_overrides(dataset: str | None) -> dict[str, Any]:
    """The `--quick` preset: narrow experts, few epochs, a subsampled grid (≲ 1 min on 2 cores)."""
    preset: dict[str, Any] = {
        "width": 64,
        "prototype_epochs": 10,
        "warmup_epochs": 5,
        "epochs": 100,
        "batch_size": 64,
        "lr": 3e-3,
        "quick": True,
    }
    if dataset in _QUICK_GRID:
        preset["grid_size"] = _QUICK_GRID[dataset]
    return preset


def quick_demo_config(out: Path) -> BuildConfig:
    """The demo store of `momlp demo`: 2-D Ackley, 16 experts, ν = 4, quick preset."""
    return BuildConfig(
        out=Path(out), dataset="ackley2d", experts=16, branching=4, **quick_overrides("ackley2d")
    )


QUICK_DEMO = quick_demo_config(Path("demo-store"))
