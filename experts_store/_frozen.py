"""FrozenExpert: an expert for inference only, its tensors and a functional forward.

Serving builds one per loaded expert instead of an ExpertMLP. Constructing the nn.Module
skeleton costs about 0.4 ms, as much as reading a small expert's file, and the module calls
add about 0.08 ms to a one-row forward of a five-layer expert (measured on the 2-core
development VM). The forward is, op for op, ExpertMLP's in eval mode (F.linear, F.batch_norm
on the running statistics, F.prelu), so its outputs are bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from experts_store._arch import ExpertArch

__all__ = ["ROW_ALIGN", "FrozenExpert"]

# Serving pads every GEMM's reduction dim (an expert's input and hidden widths) to a multiple of
# this many float32 (32 bytes). This CPU build's matmul sums a row in an order that depends on
# the row's 16-byte alignment, i.e. on its position in the batch, whenever the reduction dim is
# not a multiple of 4 floats (and the layer has < 12 outputs); with every row start aligned the
# bits do not depend on the position (DESIGN's batch invariance; benchmarks/gemm_alignment.py).
# 8 rather than 4: the AVX2 vector width, and pMoE's PATCH_ALIGN, so its experts need no copy.
ROW_ALIGN = 8

# nn.BatchNorm1d's default, which ExpertMLP uses.
_BN_EPS = 1e-5
# The functional form of ExpertMLP's parameterless activation modules (same ops, same bits).
_ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
}


class FrozenExpert:
    """Callable like an eval-mode ExpertMLP on a batch [B, d0]; never trains."""

    __slots__ = ("arch", "_layers", "_sigma", "input_width")

    def __init__(self, arch: ExpertArch, state: Mapping[str, Tensor]) -> None:
        """state: the tensors an ExpertMLP of ``arch`` has, under the same names."""
        self.arch = arch
        last = len(arch.widths) - 2
        prelu = arch.activation == "prelu"
        # F.prelu with the layer's γ, or the parameterless activation (γ slot left empty).
        self._sigma = None if prelu else _ACTIVATION_FNS[arch.activation]
        empty = torch.empty(0)
        # One tuple per layer, told apart by length: (A, b) for the output layer,
        # (A, b, γ) for a hidden one, (A, b, γ, mean, var, bn weight, bn bias) with BatchNorm.
        layers: list[tuple[Tensor, ...]] = []
        for j in range(last + 1):
            weight, bias = state[f"linears.{j}.weight"], state[f"linears.{j}.bias"]
            gamma = state[f"activations.{j}.weight"] if prelu and j < last else empty
            if j == last:
                layers.append((weight, bias))
            elif arch.batchnorm:
                norm = tuple(
                    state[f"norms.{j}.{leaf}"]
                    for leaf in ("running_mean", "running_var", "weight", "bias")
                )
                layers.append((weight, bias, gamma, *norm))
            else:
                layers.append((weight, bias, gamma))
        self._layers = layers
        # Columns __call__ takes: arch.input_dim, or more once `aligned` padded it.
        self.input_width = arch.input_dim

    def aligned(self, align: int = ROW_ALIGN) -> FrozenExpert:
        """The same function with input and hidden widths zero-padded to multiples of `align`.

        Padded input columns meet zero weights; a padded hidden unit has zero weights, bias
        and (BatchNorm) shift, so whatever σ(0) is (sigmoid's 0.5) its zero outgoing weights
        add exactly 0 to every real unit. Returns self when nothing needs padding. Callers
        pass `input_width` columns, or `arch.input_dim` ones that __call__ pads.
        """
        widths = self.arch.widths
        padded = [-(-w // align) * align for w in widths[:-1]] + [widths[-1]]
        if list(widths) == padded:
            return self
        layers: list[tuple[Tensor, ...]] = []
        for j, layer in enumerate(self._layers):
            rows, cols = padded[j + 1] - widths[j + 1], padded[j] - widths[j]
            weight = F.pad(layer[0], (0, cols, 0, rows))
            # Running variance pads with 1 so a padded unit normalises 0 to 0, not 0/√ε.
            rest = [
                F.pad(t, (0, rows), value=1.0 if k == 4 else 0.0) if t.numel() else t
                for k, t in enumerate(layer[1:], start=1)
            ]
            layers.append((weight.contiguous(), *rest))
        out = FrozenExpert.__new__(FrozenExpert)
        out.arch, out._sigma, out._layers = self.arch, self._sigma, layers
        out.input_width = padded[0]
        return out

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> FrozenExpert:
        """The frozen form of an ExpertMLP (its current tensors, shared, not copied)."""
        arch = getattr(module, "arch", None)
        if not isinstance(arch, ExpertArch):
            raise TypeError("from_module takes an ExpertMLP")
        return cls(arch, dict(module.state_dict(keep_vars=False)))

    @property
    def device(self) -> torch.device:
        return self._layers[0][0].device

    def nbytes(self) -> int:
        """Bytes of the tensors it holds: an ExpertMLP's, less BatchNorm's batch counters."""
        return sum(t.numel() * t.element_size() for layer in self._layers for t in layer)

    def __call__(self, x: Tensor) -> Tensor:
        # An aligned expert also takes the unpadded width (padded here: a fresh, aligned copy).
        pad = self.input_width - x.shape[-1] if x.shape[-1] == self.arch.input_dim else 0
        h = F.pad(x, (0, pad)) if pad else x
        for layer in self._layers:
            h = F.linear(h, layer[0], layer[1])
            if len(layer) == 2:
                break
            if len(layer) == 7:
                mean, var, weight, bias = layer[3:]
                h = F.batch_norm(h, mean, var, weight, bias, False, 0.0, _BN_EPS)
            h = F.prelu(h, layer[2]) if self._sigma is None else self._sigma(h)
        return h
