"""The linear lift: a linear softmax router served exactly by the prototype tree.

A linear router scores expert i by the logit wᵢᵀx + bᵢ. Lift rows and prototypes to
x̃ = [x, 1, 0, 0] and w̃ᵢ = [wᵢ, bᵢ, hᵢ, lᵢ] with hᵢ² + lᵢ² = M − ‖wᵢ‖² − bᵢ² and
M ≥ maxᵢ ‖wᵢ‖² + bᵢ²; then ‖x̃ − w̃ᵢ‖² = ‖x‖² + 1 + M − 2(wᵢᵀx + bᵢ), a constant per row
minus twice the logit. So the nearest lifted prototypes are the largest logits, and
softmax(logits/τ) = softmax(−‖x̃ − w̃ᵢ‖²/(2τ)): the sqdist prototype gate on lifted points at
temperature 2τ, exactly (exact routing; the tree walk on lifted points is an approximation).

Why two extra coordinates, not one √(M − ‖wᵢ‖² − bᵢ²): prototypes are stored as float32, and
one rounded coordinate would leave ‖w̃ᵢ‖² off M by ~1e-7·M, a per-expert error in the logit
that is large against a small τ. hᵢ is √(M − rᵢ) rounded down to float32 and lᵢ carries the
remainder, so hᵢ² + lᵢ² equals M − rᵢ to float64 precision (rᵢ = ‖wᵢ‖² + bᵢ² of the float32
weights, in float64).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._exceptions import RouterBuildError

__all__ = [
    "LIFT_EXTRA_DIMS", "lift_rows", "lifted_temperature", "linear_lift", "linear_logits", "unlift",
]

LIFT_EXTRA_DIMS = 3


def linear_lift(weights: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """Lifted prototypes [K, n + 3] float32 of a linear router (weights [K, n], biases [K])."""
    w = weights.detach().to("cpu", torch.float32)
    b = biases.detach().to("cpu", torch.float32).reshape(-1)
    if w.dim() != 2 or b.shape[0] != w.shape[0]:
        raise RouterBuildError(f"linear router shapes {list(w.shape)} and {list(b.shape)}")
    if not (bool(torch.isfinite(w).all()) and bool(torch.isfinite(b).all())):
        raise RouterBuildError("linear router weights contain NaN or infinite values")
    r = (w.double() ** 2).sum(dim=1) + b.double() ** 2
    rest = (r.max() - r).numpy()  # M = the largest norm: every remainder is >= 0
    high = np.sqrt(rest).astype(np.float32)
    # Round down: high² must not exceed the remainder, whose rest goes to the last coordinate.
    over = high.astype(np.float64) ** 2 > rest
    high[over] = np.nextafter(high[over], np.float32(0))
    low = np.sqrt(np.maximum(rest - high.astype(np.float64) ** 2, 0.0)).astype(np.float32)
    extra = torch.as_tensor(np.stack([high, low], axis=1))
    return torch.cat([w, b[:, None], extra], dim=1)


def lift_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [B, n] as the lift's queries [B, n + 3]: [x, 1, 0, 0] (same dtype)."""
    b = x.shape[0]
    ones = torch.ones((b, 1), dtype=x.dtype, device=x.device)
    zeros = torch.zeros((b, 2), dtype=x.dtype, device=x.device)
    return torch.cat([x, ones, zeros], dim=1)


def unlift(prototypes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [K, n], biases [K]) of lifted prototypes: the router they serve."""
    n = prototypes.shape[1] - LIFT_EXTRA_DIMS
    return prototypes[:, :n], prototypes[:, n]


def linear_logits(prototypes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float64 logits wᵢᵀx + bᵢ [B, K] of the router that lifted `prototypes` encode."""
    w, b = unlift(prototypes)
    return x.to(torch.float64) @ w.to(torch.float64).T + b.to(torch.float64)


def lifted_temperature(router_temperature: float) -> float:
    """The sqdist temperature on lifted points equal to softmax(logits / τ)."""
    if not (math.isfinite(router_temperature) and router_temperature > 0):
        raise RouterBuildError(f"temperature must be > 0, got {router_temperature!r}")
    return 2.0 * router_temperature
