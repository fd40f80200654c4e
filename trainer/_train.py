"""The per-network training loop (plain torch, no Ray): minibatch Adam/AdamW on one cell's data.

Appendix D.3: regression uses Adam (lr 1e-4) on the squared error; classification uses
AdamW (lr 1e-3) on cross-entropy, optionally weighted inversely to the class frequencies
of the expert's own Voronoi cell (Section 6.2, "weighted").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = [
    "LossName",
    "TrainResult",
    "adam",
    "class_weights",
    "make_loss",
    "predict",
    "rescale_output",
    "target_scaling",
    "train_network",
]

logger = logging.getLogger(__name__)

LossName = Literal["mse", "ce", "weighted-ce"]
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class TrainResult:
    final_loss: float  # mean training loss over the last epoch (nan when nothing was trained)
    epochs: int
    steps: int
    seconds: float
    # With validation rows: the epoch whose weights were kept (0: the starting weights) and
    # their validation loss. None / nan when the last epoch's weights are kept.
    best_epoch: int | None = None
    validation_loss: float = float("nan")


def adam(
    params: Iterable[Tensor] | Iterable[dict[str, Any]],
    *,
    lr: float,
    optimizer: Literal["adam", "adamw"] = "adam",
) -> torch.optim.Optimizer:
    """Adam (regression) or AdamW (classification), each step as one `foreach` pass.

    torch takes the `foreach` path by default only on CUDA. On CPU it computes the same bits
    as the per-parameter loop (tests/trainer/test_train.py) in fewer Python-level steps: a
    small-scale Table 4 build took 0.79-0.95x the time (benchmarks/RESULTS.md).
    """
    opt_cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    return opt_cls(params, lr=lr, foreach=True)


def class_weights(labels: Tensor, num_classes: int) -> Tensor:
    """Weights ∝ 1/frequency of each class present in `labels`, averaging 1 over the samples."""
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float32)
    present = counts > 0
    weights = torch.ones(num_classes, dtype=torch.float32)
    weights[present] = labels.numel() / (present.sum() * counts[present])
    return weights


def make_loss(loss: LossName, targets: Tensor, num_classes: int = 0) -> LossFn:
    """The loss ℓ of eq. (40) for one cell; weighted-ce derives its weights from `targets`."""
    if loss == "mse":
        return nn.functional.mse_loss
    if loss == "ce":
        return nn.functional.cross_entropy
    weight = class_weights(targets, num_classes)

    def weighted_ce(logits: Tensor, labels: Tensor) -> Tensor:
        return nn.functional.cross_entropy(logits, labels, weight=weight.to(logits.device))

    return weighted_ce


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def train_network(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    loss_fn: LossFn,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: Literal["adam", "adamw"] = "adam",
    generator: torch.Generator | None = None,
    on_epoch: Callable[[int, float], None] | None = None,
    validation: tuple[Tensor, Tensor] | None = None,
) -> TrainResult:
    """Train `model` in place on (x, y) for `epochs` shuffled passes; leaves it in eval mode.

    x, y live on the model's device. on_epoch(epoch, mean_loss) is called after each pass.
    With `validation` rows (x_val, y_val), the model ends with the weights, among the
    starting ones and those after each pass, whose loss on them is lowest: at a constant
    learning rate Adam's last iterate sits anywhere in its noise band, and the best one is
    nearer the paper's arg min over a training-and-validation split.
    """
    start = time.perf_counter()
    rows = int(x.shape[0])
    skip_singletons = _has_batchnorm(model)
    if rows == 0 or epochs <= 0 or (skip_singletons and rows < 2):
        model.eval()
        return TrainResult(float("nan"), 0, 0, time.perf_counter() - start)
    opt = adam(model.parameters(), lr=lr, optimizer=optimizer)
    keeper = None if validation is None or validation[0].shape[0] == 0 else _BestWeights(
        model, *validation, loss_fn
    )
    model.train()
    steps = 0
    mean_loss = float("nan")
    for epoch in range(epochs):
        order = torch.randperm(rows, generator=generator).to(x.device)
        # Summed on the device and read once per epoch: reading each step's loss would wait
        # for the step to finish, so a GPU could never run ahead of the Python loop.
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        seen = 0
        for begin in range(0, rows, batch_size):
            idx = order[begin : begin + batch_size]
            # BatchNorm cannot normalise a batch of one row in training mode.
            if skip_singletons and idx.numel() < 2:
                continue
            opt.zero_grad(set_to_none=True)
            batch_loss = loss_fn(model(x[idx]), y[idx])
            batch_loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            steps += 1
            total += batch_loss.detach().double() * idx.numel()
            seen += idx.numel()
        mean_loss = float(total) / max(seen, 1)
        if keeper is not None:
            keeper.offer(epoch + 1)
        if on_epoch is not None:
            on_epoch(epoch, mean_loss)
    model.eval()
    if keeper is None:
        return TrainResult(mean_loss, epochs, steps, time.perf_counter() - start)
    keeper.restore()
    return TrainResult(
        mean_loss, epochs, steps, time.perf_counter() - start,
        best_epoch=keeper.epoch, validation_loss=keeper.loss,
    )


class _BestWeights:
    """The weights with the lowest validation loss seen so far, starting with the model's own."""

    def __init__(self, model: nn.Module, x: Tensor, y: Tensor, loss_fn: LossFn) -> None:
        self._model, self._x, self._y, self._loss_fn = model, x, y, loss_fn
        self.epoch = 0
        self.loss = self._score()
        self._state = self._copy()

    def offer(self, epoch: int) -> None:
        loss = self._score()
        # A NaN loss never displaces a finite one: the weights it came from have diverged.
        if loss < self.loss or not math.isfinite(self.loss):
            self.epoch, self.loss, self._state = epoch, loss, self._copy()

    def restore(self) -> None:
        self._model.load_state_dict(self._state)

    def _score(self) -> float:
        with torch.no_grad():
            loss = float(self._loss_fn(predict(self._model, self._x), self._y))
        self._model.train()
        return loss

    def _copy(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self._model.state_dict().items()}


@torch.no_grad()
def predict(model: nn.Module, x: Tensor, batch_size: int = 8192) -> Tensor:
    """model(x) in eval mode, in blocks so the activation peak stays bounded."""
    model.eval()
    if x.shape[0] == 0:
        probe: Tensor = model(torch.zeros(1, x.shape[1], dtype=x.dtype, device=x.device))
        return probe[:0]
    return torch.cat([model(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])


def target_scaling(y: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, std) per output column of regression targets; std 1 where it is ~0."""
    if y.shape[0] == 0:
        return torch.zeros(y.shape[1:], device=y.device), torch.ones(y.shape[1:], device=y.device)
    mean = y.mean(dim=0)
    std = y.std(dim=0, correction=0)
    return mean, torch.where(std > 1e-8, std, torch.ones_like(std))


@torch.no_grad()
def rescale_output(model: nn.Module, scale: Tensor, shift: Tensor) -> None:
    """Make the model compute scale·f(x) + shift by editing its last Linear layer in place.

    Lets a network train on standardised targets and still be served on the raw scale, with
    nothing extra in its file.
    """
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    last.weight.mul_(scale[:, None].to(last.weight))
    last.bias.mul_(scale.to(last.bias)).add_(shift.to(last.bias))
