"""What one Ray task does: train one expert on its cell (Algorithm 2, stages 2-3) or the baseline.

The functions here are plain Python; the build wraps them with `ray.remote`. A task gets its
data as arrays (from `ray.put`), writes its expert with `save_expert` straight into the
store's staging directory and returns only a small metrics dict, so the driver never holds
the trained experts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn

from ._datasets import Task
from ._train import (
    LossName,
    TrainResult,
    make_loss,
    predict,
    rescale_output,
    target_scaling,
    train_network,
)

__all__ = [
    "ExpertJob",
    "TrainSpec",
    "baseline_job",
    "expert_job",
    "pick_device",
    "score_outputs",
    "validation_split",
]

logger = logging.getLogger(__name__)

StateArrays = dict[str, npt.NDArray[np.generic]]


@dataclass(frozen=True)
class TrainSpec:
    """How a network is trained; shared by the experts and the baseline."""

    task: Task
    loss: LossName
    num_classes: int
    epochs: int
    lr: float
    batch_size: int
    optimizer: Literal["adam", "adamw"]
    seed: int
    torch_threads: int = 1
    # Regression: train on the network's own standardised targets (Adam moves each weight by
    # ~lr per step, so raw targets of scale 10-100 would need far more steps), then fold the
    # scale back into the last layer so the saved file serves raw values.
    standardize_targets: bool = True
    # "best-validation": hold `validation_fraction` of each network's rows out of training and
    # keep the epoch whose weights score lowest on them (the paper's 80 % is "for training
    # and validation", Section 6.1); "last": train on every row, keep the last epoch.
    select_epoch: Literal["last", "best-validation"] = "last"
    validation_fraction: float = 0.1


@dataclass(frozen=True)
class ExpertJob:
    """One expert's task: start from `initial_state` (the small network trained with the
    prototypes) or from a fresh small network warmed up on the cell, deepen, train, save."""

    expert_id: int
    out_path: str
    small_arch: str  # ExpertArch JSON of the small network
    extra_layers: int
    warmup_epochs: int
    noise_std: float
    spec: TrainSpec
    initial_state: StateArrays | None = None
    # Test hook: the first attempt creates this file and kills its worker (os._exit), so the
    # retry path of the build is exercised; later attempts see the file and train normally.
    crash_marker: str | None = None


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _tensors(
    x: npt.NDArray[np.float32], y: npt.NDArray[np.generic], task: Task, device: torch.device
) -> tuple[Tensor, Tensor]:
    # torch.tensor copies: Ray hands out read-only zero-copy views of the object store.
    xt = torch.tensor(np.asarray(x), dtype=torch.float32, device=device)
    if task == "classification":
        return xt, torch.tensor(np.asarray(y), dtype=torch.int64, device=device)
    return xt, torch.tensor(np.asarray(y), dtype=torch.float32, device=device)


def expert_job(
    job: ExpertJob, x: npt.NDArray[np.float32], y: npt.NDArray[np.generic]
) -> dict[str, Any]:
    """Train expert `job.expert_id` on its cell (x, y), save it to `job.out_path`."""
    from experts_store import ExpertArch, ExpertMLP, save_expert

    retried_after_crash = False
    if job.crash_marker is not None:
        if not Path(job.crash_marker).exists():
            Path(job.crash_marker).touch()
            logger.warning("test hook: killing the worker training expert %s", job.expert_id)
            os._exit(1)
        retried_after_crash = True
    start = time.perf_counter()
    spec = job.spec
    torch.set_num_threads(spec.torch_threads)
    device = pick_device()
    generator = torch.Generator().manual_seed(spec.seed * 100_003 + job.expert_id)
    small = ExpertMLP(ExpertArch.from_json(job.small_arch), generator=generator)
    if job.initial_state is not None:
        state = {name: torch.tensor(np.asarray(a)) for name, a in job.initial_state.items()}
        small.load_state_dict(state, strict=True)
    small = small.to(device)
    fit, held = validation_split(len(x), spec, salt=job.expert_id)
    xt, yt = _tensors(x[fit], y[fit], spec.task, device)
    xv, yv = _tensors(x[held], y[held], spec.task, device)
    loss_fn = make_loss(spec.loss, yt.cpu(), spec.num_classes)
    raw_targets = yt
    yt, yv_fit, unscale = _standardize(small, yt, yv, spec)
    validation = (xv, yv_fit) if held.size else None

    def train(model: ExpertMLP, epochs: int, select: bool) -> TrainResult:
        return train_network(
            model, xt, yt, loss_fn=loss_fn, epochs=epochs, lr=spec.lr,
            batch_size=spec.batch_size, optimizer=spec.optimizer, generator=generator,
            validation=validation if select else None,
        )

    warmup_loss = float("nan")
    if job.initial_state is None and job.warmup_epochs > 0:
        warmup_loss = train(small, job.warmup_epochs, select=False).final_loss
    expert = small.deepen(job.extra_layers, noise_std=job.noise_std, generator=generator)
    result = train(expert.to(device), spec.epochs, select=True)
    unscale(expert)
    # The finished expert on its own cell, in the targets' units: final_loss is standardised and
    # averaged over the last epoch's changing weights, so it does not compare with a test figure.
    with torch.no_grad():
        train_metric = score_outputs(spec.task, predict(expert, xt).cpu(), raw_targets.cpu())
        validation_metric = score_outputs(spec.task, predict(expert, xv).cpu(), yv.cpu())
    expert = expert.cpu()
    written = save_expert(
        expert, Path(job.out_path), metadata={"expert_id": str(job.expert_id)}
    )
    if job.crash_marker is not None:
        Path(job.crash_marker).unlink(missing_ok=True)
    return {
        "expert_id": job.expert_id,
        "train_samples": int(len(x)),
        "validation_samples": int(held.size),
        "warmup_loss": warmup_loss,
        "final_loss": result.final_loss,
        "train_metric": train_metric,
        "validation_metric": validation_metric,
        "best_epoch": result.best_epoch,
        "steps": result.steps,
        "params": written.params,
        "bytes": written.bytes,
        "sha256": written.sha256,
        "device": str(device),
        "train_seconds": time.perf_counter() - start,
        "retried_after_crash": retried_after_crash,
    }


def baseline_job(
    arch_json: str,
    spec: TrainSpec,
    x_train: npt.NDArray[np.float32],
    y_train: npt.NDArray[np.generic],
    x_test: npt.NDArray[np.float32],
    y_test: npt.NDArray[np.generic],
) -> dict[str, Any]:
    """Train the single wide MLP of D.3.2 on all data; return its test metric, not its weights."""
    from experts_store import ExpertArch, ExpertMLP

    start = time.perf_counter()
    torch.set_num_threads(spec.torch_threads)
    device = pick_device()
    generator = torch.Generator().manual_seed(spec.seed * 100_003 + _BASELINE_SALT)
    model = ExpertMLP(ExpertArch.from_json(arch_json), generator=generator).to(device)
    fit, held = validation_split(len(x_train), spec, salt=_BASELINE_SALT)
    xt, yt = _tensors(x_train[fit], y_train[fit], spec.task, device)
    xv, yv = _tensors(x_train[held], y_train[held], spec.task, device)
    loss_fn = make_loss(spec.loss, yt.cpu(), spec.num_classes)
    yt, yv, unscale = _standardize(model, yt, yv, spec)
    result = train_network(
        model,
        xt,
        yt,
        loss_fn=loss_fn,
        epochs=spec.epochs,
        lr=spec.lr,
        batch_size=spec.batch_size,
        optimizer=spec.optimizer,
        generator=generator,
        validation=(xv, yv) if held.size else None,
    )
    unscale(model)
    xs, ys = _tensors(x_test, y_test, spec.task, device)
    outputs = predict(model, xs)
    return {
        "metric": "accuracy" if spec.task == "classification" else "mse",
        "value": score_outputs(spec.task, outputs.cpu(), ys.cpu()),
        "params": model.num_parameters(),
        "bytes": model.nbytes(),
        "final_loss": result.final_loss,
        "best_epoch": result.best_epoch,
        "device": str(device),
        "train_seconds": time.perf_counter() - start,
    }


# Seeds the baseline's own draws (its first weights and its validation rows) apart from the
# experts', whose ids are small.
_BASELINE_SALT = 99_991


def validation_split(
    rows: int, spec: TrainSpec, salt: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(rows to train on, rows held out for choosing the epoch), both sorted.

    A seeded draw of its own, so the training's random stream is the same with or without a
    split. A network with fewer than two rows holds nothing out.
    """
    everything = np.arange(rows, dtype=np.int64)
    if spec.select_epoch == "last" or rows < 2:
        return everything, everything[:0]
    held = min(max(1, round(rows * spec.validation_fraction)), rows - 1)
    order = np.random.default_rng([spec.seed, salt]).permutation(rows)
    return np.sort(order[held:]), np.sort(order[:held])


def _standardize(
    model: nn.Module, y: Tensor, held: Tensor, spec: TrainSpec
) -> tuple[Tensor, Tensor, Callable[[nn.Module], None]]:
    """Standardised training and held-out targets (both on the training targets' scale), with
    `model` rescaled to match; the returned function undoes the rescaling."""
    if spec.task != "regression" or not spec.standardize_targets:
        return y, held, lambda _: None
    mean, std = target_scaling(y)
    rescale_output(model, 1.0 / std, -mean / std)

    def unscale(trained: nn.Module) -> None:
        rescale_output(trained, std, mean)

    return (y - mean) / std, (held - mean) / std, unscale


def score_outputs(task: Task, outputs: Tensor, targets: Tensor) -> float:
    """Mean squared error over all output entries, or top-1 accuracy."""
    if targets.shape[0] == 0:
        return float("nan")
    if task == "classification":
        return float((outputs.argmax(dim=1) == targets).to(torch.float64).mean())
    return float(((outputs.to(torch.float64) - targets.to(torch.float64)) ** 2).mean())
