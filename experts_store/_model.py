"""The expert: a PReLU MLP with one trainable γ per neuron (Definition 3.1 / eq. (2)), or
an MLP with another hidden activation (`ExpertArch.activation`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from experts_store._arch import ExpertArch

__all__ = ["ExpertMLP"]


class _Linear(nn.Linear):
    """nn.Linear that skips its random init on "meta": the loader assigns the file's
    tensors afterwards, and a meta init costs more than reading a small expert."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


def _activation_module(arch: ExpertArch, width: int, device: torch.device) -> nn.Module:
    if arch.activation == "prelu":
        return nn.PReLU(num_parameters=width, init=arch.prelu_init, device=device)
    # FrozenExpert's forward applies the functional form of the same op (bit-identical).
    modules: dict[str, type[nn.Module]] = {
        "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
    }
    return modules[arch.activation]()


class ExpertMLP(nn.Module):
    """x ↦ A(J) x(J) + b(J), x(j+1) = σ_γ(j)(BN?(A(j) x(j) + b(j))), x(0) = x.

    Tensor names (the file format relies on them): ``linears.{j}.weight|bias`` for
    j = 0..J, ``activations.{j}.weight`` (the γ vector; PReLU only) and, with BatchNorm,
    ``norms.{j}.*`` for j = 0..J-1.
    """

    def __init__(
        self,
        arch: ExpertArch,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Build and initialise the expert; on ``device="meta"`` only the skeleton is built
        (the loader assigns the file's tensors afterwards, paying no random init)."""
        super().__init__()
        self.arch = arch
        target = torch.device(device) if device is not None else torch.device("cpu")
        widths = arch.widths
        # Linear's own reset_parameters cannot take a generator: build it on meta and
        # initialise once below, instead of paying two random inits.
        self.linears = nn.ModuleList(
            _Linear(d_in, d_out, device="meta")
            for d_in, d_out in zip(widths, widths[1:], strict=False)
        )
        self.activations = nn.ModuleList(
            _activation_module(arch, width, target) for width in arch.hidden_widths
        )
        self.norms = (
            nn.ModuleList(nn.BatchNorm1d(width, device=target) for width in arch.hidden_widths)
            if arch.batchnorm
            else nn.ModuleList()
        )
        if target.type != "meta":
            self.linears.to_empty(device=target)
            self._init_linears(generator)

    @torch.no_grad()
    def _init_linears(self, generator: torch.Generator | None) -> None:
        # Same distribution as torch.nn.Linear's default (kaiming_uniform with a=√5).
        for linear in self.linears:
            assert isinstance(linear, nn.Linear)
            bound = 1.0 / math.sqrt(linear.in_features)
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        h = x
        last = len(self.linears) - 1
        for j, linear in enumerate(self.linears):
            h = linear(h)
            if j == last:
                break
            if self.arch.batchnorm:
                h = self.norms[j](h)
            h = self.activations[j](h)
        return h

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def nbytes(self) -> int:
        """Bytes of parameters and buffers (what the expert occupies on its device)."""
        tensors = [*self.parameters(), *self.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def deepen(
        self,
        extra_layers: int,
        *,
        noise_std: float = 1e-3,
        generator: torch.Generator | None = None,
    ) -> ExpertMLP:
        """A new expert with ``extra_layers`` near-identity hidden layers before the output
        layer (Appendix D.2): weights I + N(0, noise_std²), biases 0. With noise_std = 0 the
        function is unchanged (exactly, without BatchNorm; in eval mode with BatchNorm).

        The new layers' γ are 1 (not ``arch.prelu_init``): the previous PReLU's outputs can
        be negative (γ ≠ 0), and only σ_1 = id passes them through unchanged, so the new
        layer is exactly the linear map (I + noise) and the output moves by
        A(J)·(product of (I + E_l) − I)·x(J), small for small noise. ReLU experts are as
        exact (the previous layer's outputs are ≥ 0, which ReLU passes unchanged); with GELU,
        tanh or sigmoid the new layers apply σ to near-copies of their inputs, which is not
        the identity: the deepened expert starts as a different function, and training
        after deepening (the trainer always trains it) starts from there.
        """
        if noise_std < 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std}")
        arch = self.arch.deepened(extra_layers)
        first = self.linears[0]
        assert isinstance(first, nn.Linear)
        device, dtype = first.weight.device, first.weight.dtype
        new = ExpertMLP(arch, device="meta")
        old_hidden = len(self.arch.hidden_widths)
        width = self.arch.widths[-2]
        state: dict[str, Tensor] = {}
        for name, tensor in self.state_dict().items():
            group, index, leaf = name.split(".")
            if group == "linears" and int(index) == len(self.linears) - 1:
                name = f"linears.{len(new.linears) - 1}.{leaf}"
            state[name] = tensor.detach().clone()
        eye = torch.eye(width, device=device, dtype=dtype)
        for offset in range(extra_layers):
            j = old_hidden + offset
            weight = eye.clone()
            if noise_std > 0:
                noise = torch.randn((width, width), generator=generator, dtype=dtype, device="cpu")
                weight += noise.to(device) * noise_std
            state[f"linears.{j}.weight"] = weight
            state[f"linears.{j}.bias"] = torch.zeros(width, device=device, dtype=dtype)
            if arch.activation == "prelu":
                state[f"activations.{j}.weight"] = torch.ones(width, device=device, dtype=dtype)
            if arch.batchnorm:
                # Eval-mode BatchNorm computes (x - mean) / sqrt(var + eps); var = 1 - eps
                # makes it the identity, so the deepened expert serves like the original.
                norm = new.norms[j]
                assert isinstance(norm, nn.BatchNorm1d)
                eps = norm.eps
                state[f"norms.{j}.weight"] = torch.ones(width, device=device, dtype=dtype)
                state[f"norms.{j}.bias"] = torch.zeros(width, device=device, dtype=dtype)
                state[f"norms.{j}.running_mean"] = torch.zeros(width, device=device, dtype=dtype)
                state[f"norms.{j}.running_var"] = torch.full(
                    (width,), 1.0 - eps, device=device, dtype=dtype
                )
                state[f"norms.{j}.num_batches_tracked"] = torch.zeros(
                    (), device=device, dtype=torch.long
                )
        new.load_state_dict(state, strict=True, assign=True)
        new.train(self.training)
        return new
