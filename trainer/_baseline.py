"""The paper's baseline (D.3.2): one MLP of the experts' depth and width w·√K, on all data."""

from __future__ import annotations

import math

from experts_store import Activation, ExpertArch

__all__ = ["baseline_arch", "baseline_width"]


def baseline_width(width: int, num_experts: int) -> int:
    """w·√K, rounded: the hidden-weight count then matches all K experts' together."""
    return max(1, int(round(width * math.sqrt(num_experts))))


def baseline_arch(
    input_dim: int, output_dim: int, *, width: int, depth: int, num_experts: int, batchnorm: bool,
    activation: Activation = "prelu",
) -> ExpertArch:
    hidden = (baseline_width(width, num_experts),) * depth
    return ExpertArch(
        widths=(input_dim, *hidden, output_dim), batchnorm=batchnorm, activation=activation
    )
