"""Prototype discovery (Appendix D.2): k-means, or the paper's gradient phase of eq. (39).

The gradient phase trains K small networks jointly with the prototypes p_1..p_K, mixing the
networks' outputs with softmax(−‖x − p_i‖); the trained small networks are then deepened
and trained further per cell (Algorithm 2).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn

from ._train import LossFn, adam

__all__ = [
    "MixtureOfSmallNetworks", "kmeans_prototypes", "learned_prototypes", "run_joint_epochs",
]

logger = logging.getLogger(__name__)


def kmeans_prototypes(x: npt.NDArray[np.float32], num_experts: int, *, seed: int = 0) -> Tensor:
    """K-means centroids of the training inputs, float32 [K, n]."""
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        # Fewer distinct points than clusters only duplicates centroids; routing copes (ties go
        # to the lowest index), so this is logged below rather than fatal.
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = KMeans(n_clusters=num_experts, n_init=3, random_state=seed).fit(
            np.asarray(x, dtype=np.float64)
        )
    centers = torch.as_tensor(np.asarray(model.cluster_centers_), dtype=torch.float32)
    distinct = torch.unique(centers, dim=0).shape[0]
    if distinct < num_experts:
        logger.warning("k-means found only %s distinct prototypes of %s", distinct, num_experts)
    return centers


class MixtureOfSmallNetworks(nn.Module):
    """x ↦ Σ_i softmax(−‖x − p_i‖)_i · f_i(x), eq. (39); prototypes and networks both learn."""

    def __init__(self, prototypes: Tensor, networks: Sequence[nn.Module]) -> None:
        super().__init__()
        if prototypes.shape[0] != len(networks):
            raise ValueError("one network per prototype")
        self.prototypes = nn.Parameter(prototypes.clone().to(torch.float32))
        self.networks = nn.ModuleList(networks)

    def gate(self, x: Tensor) -> Tensor:
        diff = x[:, None, :] - self.prototypes[None, :, :]
        # The epsilon keeps the gradient of the norm finite when x sits on a prototype.
        distances = torch.sqrt((diff * diff).sum(dim=-1) + 1e-12)
        return torch.softmax(-distances, dim=1)

    def forward(self, x: Tensor) -> Tensor:
        weights = self.gate(x)
        outputs = torch.stack([net(x) for net in self.networks], dim=1)  # [B, K, out]
        return (weights[:, :, None] * outputs).sum(dim=1)


def run_joint_epochs(
    mixture: nn.Module,
    x: Tensor,
    y: Tensor,
    opt: torch.optim.Optimizer,
    *,
    loss_fn: LossFn,
    epochs: int,
    batch_size: int,
    generator: torch.Generator | None,
    before_epoch: Callable[[int], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> None:
    """Minibatch epochs of a joint phase (gate and small networks together), in train mode."""
    rows = int(x.shape[0])
    # The epoch's loss only feeds a debug line. Reading a step's loss waits for the step, so
    # a GPU could never run ahead of the Python loop: it is summed on the device, if at all.
    log_loss = logger.isEnabledFor(logging.DEBUG)
    mixture.train()
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(epoch)
        order = torch.randperm(rows, generator=generator).to(x.device)
        total = torch.zeros((), dtype=torch.float64, device=x.device) if log_loss else None
        for begin in range(0, rows, batch_size):
            idx = order[begin : begin + batch_size]
            if idx.numel() < 2:
                continue
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(mixture(x[idx]), y[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            if after_step is not None:
                after_step()
            if total is not None:
                total += loss.detach().double() * idx.numel()
        if total is not None:
            logger.debug("joint epoch %s: loss %.6g", epoch, float(total) / max(rows, 1))


def learned_prototypes(
    x: Tensor,
    y: Tensor,
    networks: Sequence[nn.Module],
    *,
    loss_fn: LossFn,
    epochs: int,
    lr: float,
    prototype_lr: float,
    batch_size: int,
    optimizer: Literal["adam", "adamw"] = "adam",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Train `networks` (in place) and K prototypes under eq. (39); returns prototypes [K, n].

    Prototypes start uniformly at random within the bounding box of x (Appendix D.2) and are
    projected back into it after every step.
    """
    num_experts = len(networks)
    low = x.min(dim=0).values
    high = x.max(dim=0).values
    uniform = torch.rand(num_experts, x.shape[1], generator=generator, dtype=torch.float32)
    start = low + (high - low) * uniform.to(x.device)
    mixture = MixtureOfSmallNetworks(start, networks).to(x.device)
    opt = adam(
        [
            {"params": [mixture.prototypes], "lr": prototype_lr},
            {"params": mixture.networks.parameters(), "lr": lr},
        ],
        lr=lr,
        optimizer=optimizer,
    )

    def keep_in_box() -> None:
        # Keep prototypes within the data's bounding box: one that drifts outside wins
        # no training points and its expert would be wasted.
        with torch.no_grad():
            mixture.prototypes.clamp_(min=low, max=high)

    run_joint_epochs(mixture, x, y, opt, loss_fn=loss_fn, epochs=epochs, batch_size=batch_size,
                     generator=generator, after_step=keep_in_box)
    mixture.eval()
    return mixture.prototypes.detach().clone().cpu()
