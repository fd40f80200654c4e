"""The learned linear gate (`momlp build --gate learned-linear`): a softmax router with logits
wᵢᵀx + bᵢ trained jointly with the K small networks, in place of eq. (39)'s prototypes.

The temperature τ of softmax(logits/τ) is fixed, or follows a geometric schedule from a start
to an end value over the joint phase's epochs; it is never a trained parameter. Seed 002,
Thm 3: a linear router with a *learned* temperature estimates slower than any polynomial
rate (the temperature and the router's scale trade off), so τ is given, not fitted.

The router starts as the sqdist prototype gate of random points pᵢ of the data's bounding
box (wᵢ = 2pᵢ, bᵢ = −‖pᵢ‖², the same logits up to a per-row constant), so training starts
from the same Voronoi partition eq. (39) starts from. The trained router is served through
the prototype tree by the linear lift (router/_lift.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ._prototypes import run_joint_epochs
from ._train import LossFn, adam

__all__ = ["LinearRouterMixture", "TemperatureSchedule", "learned_linear_router"]

@dataclass(frozen=True)
class TemperatureSchedule:
    """τ per epoch: geometric from `start` to `end` (equal: fixed)."""

    start: float
    end: float

    def at(self, epoch: int, epochs: int) -> float:
        if epochs <= 1:
            return self.end
        frac = epoch / (epochs - 1)
        return self.start * math.exp(frac * math.log(self.end / self.start))

    @property
    def final(self) -> float:
        """The τ the router ends training with: the one the store serves."""
        return self.end


class LinearRouterMixture(nn.Module):
    """x ↦ Σᵢ softmax((Wx + b)/τ)ᵢ · fᵢ(x); W, b and the networks learn, τ is set."""

    def __init__(self, weights: Tensor, biases: Tensor, networks: Sequence[nn.Module]) -> None:
        super().__init__()
        if weights.shape[0] != len(networks) or biases.shape[0] != len(networks):
            raise ValueError("one router row per network")
        self.weight = nn.Parameter(weights.clone().to(torch.float32))
        self.bias = nn.Parameter(biases.clone().to(torch.float32))
        self.networks = nn.ModuleList(networks)
        self.temperature = 1.0  # a plain float: never a parameter (Thm 3)

    def logits(self, x: Tensor) -> Tensor:
        return x @ self.weight.T + self.bias

    def gate(self, x: Tensor) -> Tensor:
        return torch.softmax(self.logits(x) / self.temperature, dim=1)

    def forward(self, x: Tensor) -> Tensor:
        weights = self.gate(x)
        outputs = torch.stack([net(x) for net in self.networks], dim=1)  # [B, K, out]
        return (weights[:, :, None] * outputs).sum(dim=1)


def learned_linear_router(
    x: Tensor,
    y: Tensor,
    networks: Sequence[nn.Module],
    *,
    loss_fn: LossFn,
    schedule: TemperatureSchedule,
    epochs: int,
    lr: float,
    router_lr: float,
    batch_size: int,
    optimizer: Literal["adam", "adamw"] = "adam",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Train `networks` (in place) and a linear router; returns (weights [K, n], biases [K])."""
    num_experts = len(networks)
    low = x.min(dim=0).values
    high = x.max(dim=0).values
    uniform = torch.rand(num_experts, x.shape[1], generator=generator, dtype=torch.float32)
    points = low + (high - low) * uniform.to(x.device)
    mixture = LinearRouterMixture(2.0 * points, -(points * points).sum(dim=1), networks)
    mixture = mixture.to(x.device)
    opt = adam(
        [
            {"params": [mixture.weight, mixture.bias], "lr": router_lr},
            {"params": mixture.networks.parameters(), "lr": lr},
        ],
        lr=lr,
        optimizer=optimizer,
    )
    def set_temperature(epoch: int) -> None:
        mixture.temperature = schedule.at(epoch, epochs)

    run_joint_epochs(mixture, x, y, opt, loss_fn=loss_fn, epochs=epochs, batch_size=batch_size,
                     generator=generator, before_epoch=set_temperature)
    mixture.eval()
    return mixture.weight.detach().clone().cpu(), mixture.bias.detach().clone().cpu()
