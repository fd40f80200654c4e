"""Paper 003's three models with the settings of its Sec. 5.1, and their training (Sec. 3.2).

    model = separate_pmoe(num_patches=16, patch_dim=64)          # k = 2, l = 2, 20 neurons each
    history = train_model(model, x, y, "separate", TrainSettings(seed=0))

Settings from the paper and the authors' code (nowazrabbani/pMoE_CNN, MNIST experiment):
plain SGD, learning rate 0.2, batch 20, 150 epochs for experts and CNN, 100 epochs for the
separately trained routers (linear loss, eq. 6); 40 hidden neurons in all (2 experts x 20,
8 experts x 5, or the CNN's 40); initial weights N(0, 0.1^2) for the router and experts of
separate training and for the CNN, N(0, 1e-4^2) for joint routers and N(0, 0.01^2) for joint
experts; fixed output layers: +-1 by expert (separate) or N(0, 1) (joint, CNN).

The authors' CNN script has 4 hidden neurons where the paper's text says 40; we follow the text
(the same total width as the pMoE models).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from ._exceptions import PMoEConfigError
from ._model import PatchCNN, PatchMoE, as_patches

__all__ = [
    "TrainHistory",
    "TrainMode",
    "TrainSettings",
    "joint_pmoe",
    "patch_cnn",
    "predict_logits",
    "separate_pmoe",
    "train_model",
    "train_router_linear",
]

TrainMode = Literal["separate", "joint", "cnn"]
ArrayOrTensor = npt.NDArray[np.float32] | npt.NDArray[np.int64] | torch.Tensor

PAPER_HIDDEN_TOTAL = 40


@dataclass(frozen=True)
class TrainSettings:
    """Mini-batch SGD as in Sec. 5.1; `seed` fixes the batch order."""

    lr: float = 0.2
    batch_size: int = 20
    epochs: int = 150
    router_epochs: int = 100
    seed: int = 0
    # Called after each epoch with ("router" | "experts", epochs done); for progress bars.
    on_epoch: Callable[[str, int], None] | None = field(default=None, compare=False)


@dataclass
class TrainHistory:
    """Mean training loss per epoch (experts or CNN), per router epoch, and wall time."""

    losses: list[float] = field(default_factory=list)
    router_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def separate_pmoe(
    *,
    num_patches: int,
    patch_dim: int,
    num_classes: int = 2,
    patches_per_expert: int = 2,
    hidden_total: int = PAPER_HIDDEN_TOTAL,
    seed: int = 0,
) -> PatchMoE:
    """One expert per class (k = c; the paper's k = 2), gates all ones, expert s votes for class s.

    The class count must be even: the routers are trained in pairs of classes (App. M.1).
    """
    if num_classes % 2:
        raise PMoEConfigError(
            f"separate training pairs the classes; got an odd count {num_classes}",
            option="num_classes",
        )
    return PatchMoE(
        num_patches=num_patches,
        patch_dim=patch_dim,
        num_experts=num_classes,
        patches_per_expert=patches_per_expert,
        hidden=max(1, hidden_total // num_classes),
        num_classes=num_classes,
        gating="ones",
        output_layer="expert_class",
        router_init_std=0.1,
        expert_init_std=0.1,
        seed=seed,
    )


def joint_pmoe(
    *,
    num_patches: int,
    patch_dim: int,
    num_classes: int = 2,
    num_experts: int = 8,
    patches_per_expert: int = 6,
    hidden_total: int = PAPER_HIDDEN_TOTAL,
    seed: int = 0,
) -> PatchMoE:
    """k experts sharing `hidden_total` neurons, softmax gates, Gaussian fixed output layer."""
    return PatchMoE(
        num_patches=num_patches,
        patch_dim=patch_dim,
        num_experts=num_experts,
        patches_per_expert=patches_per_expert,
        hidden=max(1, hidden_total // num_experts),
        num_classes=num_classes,
        gating="softmax",
        output_layer="gaussian",
        router_init_std=1e-4,
        expert_init_std=0.01,
        seed=seed,
    )


def patch_cnn(
    *,
    num_patches: int,
    patch_dim: int,
    num_classes: int = 2,
    hidden: int = PAPER_HIDDEN_TOTAL,
    seed: int = 0,
) -> PatchCNN:
    """The CNN counterpart: all n patches through `hidden` neurons."""
    return PatchCNN(
        num_patches=num_patches,
        patch_dim=patch_dim,
        hidden=hidden,
        num_classes=num_classes,
        init_std=0.1,
        seed=seed,
    )


def _tensor(values: ArrayOrTensor) -> torch.Tensor:
    return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.asarray(values))


def _batches(count: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    return list(torch.split(torch.randperm(count, generator=generator), batch_size))


def train_router_linear(
    model: PatchMoE, x: ArrayOrTensor, y: ArrayOrTensor, settings: TrainSettings
) -> list[float]:
    """Train the routers alone with eq. 6's linear loss, pairwise over classes (App. M.1).

    Classes are paired (0, 1), (2, 3), ...; within pair (a, b) the loss is
    -mean(y <w_a - w_b, sum_j x^(j)>) with y = +1 for class a and -1 for b, so router a rises
    toward what class a's samples hold and router b toward class b's. Returns the mean loss per
    epoch (summed over pairs).
    """
    if model.num_experts != model.num_classes or model.num_classes % 2:
        raise PMoEConfigError(
            "pairwise router training needs one expert per class and an even class count",
            option="num_experts",
        )
    patches = as_patches(_tensor(x).float(), model.num_patches, model.patch_dim)
    patch_sums = patches.sum(dim=1)  # [N, d]
    labels = _tensor(y)
    optimizer = torch.optim.SGD([model.router], lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed)
    pairs = [(a, a + 1) for a in range(0, model.num_classes, 2)]
    members = [torch.nonzero((labels == a) | (labels == b)).flatten() for a, b in pairs]
    losses: list[float] = []
    for _ in range(settings.router_epochs):
        total = 0.0
        for (a, b), rows in zip(pairs, members, strict=True):
            count, epoch_loss = 0, 0.0
            for batch in _batches(len(rows), settings.batch_size, generator):
                picked = rows[batch]
                sign = torch.where(labels[picked] == a, 1.0, -1.0)
                value = patch_sums[picked] @ (model.router[a] - model.router[b])
                loss = -(sign * value).mean()
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                epoch_loss += loss.item() * len(picked)
                count += len(picked)
            total += epoch_loss / max(count, 1)
        losses.append(total)
        if settings.on_epoch is not None:
            settings.on_epoch("router", len(losses))
    return losses


def _fit(
    model: nn.Module,
    params: list[nn.Parameter],
    x: torch.Tensor,
    y: torch.Tensor,
    settings: TrainSettings,
) -> list[float]:
    optimizer = torch.optim.SGD(params, lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    model.train()
    for _ in range(settings.epochs):
        epoch_loss = 0.0
        for batch in _batches(len(y), settings.batch_size, generator):
            loss = loss_fn(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item() * len(batch)
        losses.append(epoch_loss / len(y))
        if settings.on_epoch is not None:
            settings.on_epoch("experts", len(losses))
    model.eval()
    return losses


def train_model(
    model: PatchMoE | PatchCNN,
    x: ArrayOrTensor,
    y: ArrayOrTensor,
    mode: TrainMode,
    settings: TrainSettings | None = None,
) -> TrainHistory:
    """Train in place: `separate` (routers by eq. 6, then experts with routers frozen),
    `joint` (routers and experts together through the softmax gates) or `cnn`.

    The loss is cross-entropy over the class logits, i.e. eq. 2's logistic loss for two classes
    and eq. 24's softmax loss for more.
    """
    settings = settings or TrainSettings()
    inputs = _tensor(x).float()
    labels = _tensor(y).long()
    if inputs.shape[0] != labels.shape[0] or inputs.shape[0] == 0:
        raise PMoEConfigError(
            f"{inputs.shape[0]} inputs for {labels.shape[0]} labels", option="data"
        )
    history = TrainHistory()
    start = time.perf_counter()
    if mode == "cnn":
        if not isinstance(model, PatchCNN):
            raise PMoEConfigError("mode cnn trains a PatchCNN", option="mode")
        history.losses = _fit(model, [model.weight], inputs, labels, settings)
    elif isinstance(model, PatchMoE) and mode in ("separate", "joint"):
        if mode == "separate":
            history.router_losses = train_router_linear(model, inputs, labels, settings)
            params = [model.expert_weight]
        else:
            params = [model.router, model.expert_weight]
        model.router.requires_grad_(mode == "joint")
        history.losses = _fit(model, params, inputs, labels, settings)
        model.router.requires_grad_(True)
    else:
        raise PMoEConfigError(
            f"mode {mode!r} does not train a {type(model).__name__}", option="mode"
        )
    history.seconds = time.perf_counter() - start
    return history


@torch.no_grad()
def predict_logits(
    model: PatchMoE | PatchCNN, x: ArrayOrTensor, batch_size: int = 256
) -> torch.Tensor:
    """Class logits [N, num_classes], computed in chunks (the result does not depend on them)."""
    inputs = _tensor(x).float()
    model.eval()
    return torch.cat([model(chunk) for chunk in torch.split(inputs, batch_size)])
