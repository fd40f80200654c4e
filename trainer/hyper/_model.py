"""The two conditioned models of paper 001: a hypernetwork and the embedding baseline.

    f = HyperNetwork(condition_dim=64, primary=PrimarySpec(64, (10,), 12), depth=4)
    theta = generate(f, condition)            # {name: tensor} per `f.layout`, no grad
    y = primary_forward(x, theta, f.primary)  # equals f(x, condition) row by row
    q = EmbeddingModel(condition_dim=64, input_dim=64, output_dim=12, depth=4)
    y = q(x, condition)                       # q([e(I), x])

Both follow the authors' code (TomerGalanti/ModularityOfHypernetworks): f and e are ReLU MLPs
of width 100 with `depth` hidden width×width layers (so depth + 2 linear layers), f's last
layer emits every weight of g; q is [e(I), x] → 10 → output with biases. PyTorch's default
initialisation throughout, as theirs.
"""

from __future__ import annotations

import torch
from torch import nn

from ._exceptions import HyperConfigError, ThetaLayoutError
from ._primary import _ACTIVATIONS, Activation, PrimarySpec, ThetaLayout, _per_row_forward

__all__ = [
    "EmbeddingModel",
    "HyperNetwork",
    "count_parameters",
    "generate",
    "paper_embedding_dim",
]

PAPER_WIDTH = 100


def paper_embedding_dim(input_dim: int, hidden: int = 10) -> int:
    """E = hidden·d + hidden: the authors' embedding size (|θ| of a d → 10 → 1 primary)."""
    return hidden * input_dim + hidden


def _trunk(in_dim: int, width: int, depth: int, out_dim: int) -> nn.Sequential:
    if depth < 0 or width < 1:
        raise HyperConfigError(f"need depth >= 0 and width >= 1, got {depth}, {width}",
                               option="depth")
    layers: list[nn.Module] = [nn.Linear(in_dim, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, out_dim))
    return nn.Sequential(*layers)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class HyperNetwork(nn.Module):
    """f: condition [m2] → θ [layout.size], and h_I(x) = g(x; f(I)) as `forward(x, condition)`."""

    def __init__(
        self, condition_dim: int, primary: PrimarySpec, depth: int, width: int = PAPER_WIDTH
    ) -> None:
        super().__init__()
        self.condition_dim = condition_dim
        self.primary = primary
        self.layout: ThetaLayout = primary.layout()
        self.depth = depth
        self.f = _trunk(condition_dim, width, depth, self.layout.size)

    def flat_theta(self, condition: torch.Tensor) -> torch.Tensor:
        """f(I) as flat vectors: condition [C, m2] → [C, layout.size] (keeps the graph)."""
        if condition.dim() != 2 or condition.shape[1] != self.condition_dim:
            raise ThetaLayoutError(
                name="condition", expected=(self.condition_dim,), got=tuple(condition.shape)
            )
        out: torch.Tensor = self.f(condition)
        return out

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        """g(x_b; f(I_b)) for each row: x [B, m1], condition [B, m2] → [B, output_dim]."""
        if x.dim() != 2 or x.shape[1] != self.primary.input_dim:
            raise ThetaLayoutError(name="x", expected=(self.primary.input_dim,),
                                   got=tuple(x.shape))
        rows = self.layout.split(self.flat_theta(condition))
        return _per_row_forward(x, rows, self.primary)

    def primary_parameters(self) -> int:
        """|θ|: the number of weights of g that f generates per condition."""
        return self.layout.size


def generate(model: HyperNetwork, condition: torch.Tensor) -> dict[str, torch.Tensor]:
    """θ_I = f(I) split into g's tensors, detached and contiguous (ready to cache or save).

    condition [m2] gives {name: [*shape]}; condition [C, m2] gives {name: [C, *shape]}, which
    `primary_forward_stacked` takes as it is.
    """
    single = condition.dim() == 1
    batch = condition.unsqueeze(0) if single else condition
    with torch.no_grad():
        flat = model.flat_theta(batch)
    theta = model.layout.split(flat[0] if single else flat)
    return {name: tensor.detach().contiguous().clone() for name, tensor in theta.items()}


class EmbeddingModel(nn.Module):
    """q(x, e(I)): e a ReLU MLP condition → embedding, q a d+E → hidden → output MLP."""

    def __init__(
        self,
        condition_dim: int,
        input_dim: int,
        output_dim: int,
        depth: int,
        embedding_dim: int | None = None,
        width: int = PAPER_WIDTH,
        hidden: int = 10,
        activation: Activation = "relu",
    ) -> None:
        super().__init__()
        self.condition_dim = condition_dim
        self.input_dim = input_dim
        self.depth = depth
        self.embedding_dim = (
            paper_embedding_dim(input_dim, hidden) if embedding_dim is None else embedding_dim
        )
        if self.embedding_dim < 1:
            raise HyperConfigError("must be >= 1", option="embedding_dim")
        self.e = _trunk(condition_dim, width, depth, self.embedding_dim)
        self.q = nn.Sequential(
            nn.Linear(self.embedding_dim + input_dim, hidden),
            _Activation(activation),
            nn.Linear(hidden, output_dim),
        )

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.input_dim:
            raise ThetaLayoutError(name="x", expected=(self.input_dim,), got=tuple(x.shape))
        if condition.dim() != 2 or condition.shape[1] != self.condition_dim:
            raise ThetaLayoutError(
                name="condition", expected=(self.condition_dim,), got=tuple(condition.shape)
            )
        out: torch.Tensor = self.q(torch.cat([self.e(condition), x], dim=1))
        return out


class _Activation(nn.Module):
    def __init__(self, name: Activation) -> None:
        super().__init__()
        self.fn = _ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
