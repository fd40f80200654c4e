"""Training and scoring of either conditioned model, as the authors did: plain SGD, no
regularisation or normalisation; MSE for regression, negative log-likelihood of the softmax
for classification.

    history = train_model(model, data, TrainSettings(lr=0.01, epochs=10, seed=0))
    evaluate_error(model, data)      # test MSE (regression) or test error rate (classification)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ._data import HyperDataset
from ._exceptions import HyperConfigError

__all__ = ["TrainHistory", "TrainSettings", "predict", "evaluate_error", "train_model"]


@dataclass(frozen=True)
class TrainSettings:
    """Mini-batch SGD; `seed` fixes the batch order (the model's init is the caller's)."""

    lr: float = 1e-3
    batch_size: int = 64
    epochs: int = 10
    momentum: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0) or self.batch_size < 1 or self.epochs < 1:
            raise HyperConfigError(
                f"need lr > 0, batch_size >= 1, epochs >= 1, got {self}", option="settings"
            )


@dataclass
class TrainHistory:
    """Mean training loss per epoch, and the wall time of the whole run."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    diverged: bool = False


def _loss(out: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    if task == "classification":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, y)


def train_model(
    model: nn.Module,
    data: HyperDataset,
    settings: TrainSettings,
    on_epoch: Callable[[int, float], None] | None = None,
) -> TrainHistory:
    """Train `model(x, condition)` on `data`'s training triples; stops early on a NaN loss
    (marked `diverged`), which the paper's learning-rate sweep meets at its largest rates.
    `on_epoch(epoch, mean loss)` is called after each epoch (a progress bar)."""
    history = TrainHistory()
    gen = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    n = data.x_train.shape[0]
    start = time.perf_counter()
    model.train()
    for _ in range(settings.epochs):
        order = torch.randperm(n, generator=gen)
        total, seen = 0.0, 0
        for lo in range(0, n, settings.batch_size):
            idx = order[lo : lo + settings.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = _loss(model(data.x_train[idx], data.condition_train[idx]),
                         data.y_train[idx], data.task)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            total += float(loss.detach()) * len(idx)
            seen += len(idx)
        history.losses.append(total / seen)
        if on_epoch is not None:
            on_epoch(len(history.losses), history.losses[-1])
        if not torch.isfinite(torch.tensor(history.losses[-1])):
            history.diverged = True
            break
    history.seconds = time.perf_counter() - start
    model.eval()
    return history


def predict(
    model: nn.Module, x: torch.Tensor, condition: torch.Tensor, batch_size: int = 1024
) -> torch.Tensor:
    """model(x, condition) in eval mode without gradients, in chunks of `batch_size` rows."""
    model.eval()
    with torch.no_grad():
        parts = [model(x[lo : lo + batch_size], condition[lo : lo + batch_size])
                 for lo in range(0, x.shape[0], batch_size)]
    return torch.cat(parts)


def evaluate_error(model: nn.Module, data: HyperDataset, split: str = "test") -> float:
    """MSE (regression) or error rate = 1 − accuracy (classification) on `split`."""
    if split == "test":
        x, cond, y = data.x_test, data.condition_test, data.y_test
    elif split == "train":
        x, cond, y = data.x_train, data.condition_train, data.y_train
    else:
        raise HyperConfigError(f"unknown split {split!r}", option="split")
    out = predict(model, x, cond)
    if data.task == "classification":
        return float((out.argmax(dim=1) != y).float().mean())
    return float(F.mse_loss(out, y))
