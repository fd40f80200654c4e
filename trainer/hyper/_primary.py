"""The primary network g(x; θ) and the layout of θ inside the hypernetwork's output.

g is a plain MLP whose weights are *inputs*, not parameters: `PrimarySpec` fixes its widths,
activation and whether it has biases; `ThetaLayout` says where each of its tensors sits in the
flat vector f(I) (row-major, one tensor after the other, in layer order, weight before bias):

    spec = PrimarySpec(input_dim=64, hidden_dims=(10,), output_dim=12)   # the paper's d → 10 → 12
    layout = spec.layout()
    [(s.name, s.shape, s.offset) for s in layout.slots]
    # [('layers.0.weight', (10, 64), 0), ('layers.1.weight', (12, 10), 640)];  layout.size == 760
    theta = layout.split(flat)                 # flat [P] or [C, P] -> {name: [*, out, in]}
    y = primary_forward(x, theta)              # one θ for every row of x
    y = primary_forward_stacked(x, stack_thetas([t0, t1]), index)   # row b uses θ_{index[b]}

A weight tensor has nn.Linear's shape [out, in]. Every form runs the same per-row batched
matmul (each row its own [out, in] @ [in, 1] product), so a row's output depends only on its
x and its θ, bitwise, whichever other rows or conditions share the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ._exceptions import HyperConfigError, ThetaLayoutError

__all__ = [
    "Activation",
    "PrimarySpec",
    "ThetaSlot",
    "ThetaLayout",
    "primary_forward",
    "primary_forward_stacked",
    "stack_thetas",
]

Activation = Literal["relu", "elu"]
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "elu": F.elu,
}


@dataclass(frozen=True)
class ThetaSlot:
    """One tensor of g: its name, shape and where its values start in the flat θ."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ThetaLayout:
    """The slots of θ in order; together they cover [0, size) with no gap and no overlap."""

    slots: tuple[ThetaSlot, ...]

    @property
    def size(self) -> int:
        return self.slots[-1].end if self.slots else 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(slot.name for slot in self.slots)

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `flat` ([P] or [C, P]) as g's tensors ([*shape] or [C, *shape])."""
        if flat.dim() not in (1, 2) or flat.shape[-1] != self.size:
            raise ThetaLayoutError(name="flat", expected=(self.size,), got=tuple(flat.shape))
        lead = tuple(flat.shape[:-1])
        return {
            slot.name: flat[..., slot.offset : slot.end].reshape(*lead, *slot.shape)
            for slot in self.slots
        }

    def join(self, theta: dict[str, torch.Tensor]) -> torch.Tensor:
        """The inverse of `split`: g's tensors (all [*shape] or all [C, *shape]) to a flat θ."""
        self._check(theta, batched=None)
        first = theta[self.slots[0].name]
        lead = tuple(first.shape[: first.dim() - len(self.slots[0].shape)])
        return torch.cat([theta[s.name].reshape(*lead, s.numel) for s in self.slots], dim=-1)

    def _check(self, theta: dict[str, torch.Tensor], *, batched: bool | None) -> None:
        if set(theta) != set(self.names):
            missing = sorted(set(self.names) - set(theta))
            extra = sorted(set(theta) - set(self.names))
            raise ThetaLayoutError(
                name=",".join(missing + extra) or "theta", expected=(), got=()
            )
        for slot in self.slots:
            got = tuple(theta[slot.name].shape)
            lead = got[: len(got) - len(slot.shape)]
            ok = got[len(lead) :] == slot.shape and len(lead) <= 1
            if batched is True:
                ok = ok and len(lead) == 1
            elif batched is False:
                ok = ok and not lead
            if not ok:
                raise ThetaLayoutError(name=slot.name, expected=slot.shape, got=got)


@dataclass(frozen=True)
class PrimarySpec:
    """g's architecture: input_dim → hidden_dims... → output_dim, `activation` between layers.

    The paper's primary has no biases (`bias=False`); with `bias=True` each layer adds a
    `layers.{i}.bias` slot right after its weight.
    """

    input_dim: int
    hidden_dims: tuple[int, ...] = (10,)
    output_dim: int = 1
    activation: Activation = "relu"
    bias: bool = False

    def __post_init__(self) -> None:
        widths = (self.input_dim, *self.hidden_dims, self.output_dim)
        if any(w < 1 for w in widths):
            raise HyperConfigError(f"widths must be >= 1, got {list(widths)}", option="primary")
        if self.activation not in _ACTIVATIONS:
            raise HyperConfigError(
                f"unknown activation {self.activation!r}", option="primary.activation"
            )

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.input_dim, *self.hidden_dims, self.output_dim)

    def layout(self) -> ThetaLayout:
        slots: list[ThetaSlot] = []
        offset = 0
        widths = self.widths
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
            slots.append(ThetaSlot(f"layers.{i}.weight", (fan_out, fan_in), offset))
            offset += fan_out * fan_in
            if self.bias:
                slots.append(ThetaSlot(f"layers.{i}.bias", (fan_out,), offset))
                offset += fan_out
        return ThetaLayout(tuple(slots))


def stack_thetas(thetas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several conditions' θ ({name: [*shape]} each) as one {name: [C, *shape]}."""
    if not thetas:
        raise HyperConfigError("need at least one θ", option="thetas")
    return {name: torch.stack([t[name] for t in thetas]) for name in thetas[0]}


def primary_forward(
    x: torch.Tensor, theta: dict[str, torch.Tensor], spec: PrimarySpec
) -> torch.Tensor:
    """g(x; θ) for one θ ({name: [*shape]}) and x [B, input_dim]; returns [B, output_dim]."""
    spec.layout()._check(theta, batched=False)
    stacked = {name: tensor.unsqueeze(0) for name, tensor in theta.items()}
    index = torch.zeros(x.shape[0] if x.dim() == 2 else 0, dtype=torch.long, device=x.device)
    return primary_forward_stacked(x, stacked, index, spec)


def primary_forward_stacked(
    x: torch.Tensor, theta: dict[str, torch.Tensor], index: torch.Tensor, spec: PrimarySpec
) -> torch.Tensor:
    """g(x_b; θ_{index[b]}) for every row b: θ stacked {name: [C, *shape]}, index [B] in [0, C).

    One batched matmul per layer over the rows' gathered weights; row b's result depends only
    on x[b] and θ_{index[b]}.
    """
    layout = spec.layout()
    layout._check(theta, batched=True)
    if x.dim() != 2 or x.shape[1] != spec.input_dim:
        raise ThetaLayoutError(name="x", expected=(spec.input_dim,), got=tuple(x.shape))
    if index.dim() != 1 or index.shape[0] != x.shape[0]:
        raise ThetaLayoutError(name="index", expected=(x.shape[0],), got=tuple(index.shape))
    rows = {name: tensor.index_select(0, index) for name, tensor in theta.items()}
    return _per_row_forward(x, rows, spec)


def _per_row_forward(
    x: torch.Tensor, rows: dict[str, torch.Tensor], spec: PrimarySpec
) -> torch.Tensor:
    """g with per-row tensors {name: [B, *shape]}; the hypernetwork's training path too."""
    act = _ACTIVATIONS[spec.activation]
    count = x.shape[0]
    if count == 1:
        # CPU bmm takes another kernel for a batch of one, whose sums round differently;
        # a copy of the row keeps every batch size on the same kernel (bitwise invariance).
        x = x.expand(2, -1)
        rows = {name: tensor.expand(2, *tensor.shape[1:]) for name, tensor in rows.items()}
    hidden = x.unsqueeze(-1)
    layers = len(spec.widths) - 1
    for i in range(layers):
        hidden = torch.bmm(rows[f"layers.{i}.weight"], hidden)
        if spec.bias:
            hidden = hidden + rows[f"layers.{i}.bias"].unsqueeze(-1)
        if i < layers - 1:
            hidden = act(hidden)
    return hidden.squeeze(-1)[:count]
