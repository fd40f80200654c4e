"""Expert activations (issue 15): `ExpertArch.activation` is stored in the file header, the
module and the frozen (serving) forward apply it, and headers written before the field
existed read as PReLU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from experts_store import (
    ACTIVATIONS,
    ExpertArch,
    ExpertFormatError,
    ExpertMLP,
    load_expert,
    load_frozen_expert,
    save_expert,
)

pytestmark = pytest.mark.unit


def _reference(state: dict[str, torch.Tensor], activation: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP written out in float64 from its tensors, independently of the module."""

    def sigma(j: int, h: torch.Tensor) -> torch.Tensor:
        if activation == "prelu":
            gamma = state[f"activations.{j}.weight"].double()
            return torch.where(h >= 0, h, gamma * h)
        if activation == "relu":
            return h.clamp(min=0)
        if activation == "gelu":
            return 0.5 * h * (1 + torch.erf(h / math.sqrt(2.0)))
        if activation == "tanh":
            return (torch.exp(2 * h) - 1) / (torch.exp(2 * h) + 1)
        return 1 / (1 + torch.exp(-h))

    h = x.double()
    layers = sum(1 for name in state if name.startswith("linears.") and name.endswith(".weight"))
    for j in range(layers):
        h = h @ state[f"linears.{j}.weight"].double().T + state[f"linears.{j}.bias"].double()
        if j < layers - 1:
            h = sigma(j, h)
    return h


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_each_activation_round_trips_and_computes_the_reference(
    tmp_path: Path, activation: str
) -> None:
    arch = ExpertArch(widths=(4, 16, 16, 3), activation=activation)  # type: ignore[arg-type]
    expert = ExpertMLP(arch, generator=torch.Generator().manual_seed(3)).eval()
    path = tmp_path / "e.safetensors"
    written = save_expert(expert, path)
    assert written.params == expert.num_parameters() == arch.num_parameters()
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        names = set(f.keys())
    # PReLU files are version 1 byte for byte; the others say their activation, version 2.
    header_arch = json.loads(meta["arch"])
    if activation == "prelu":
        assert meta["format_version"] == "1" and "activation" not in header_arch
        assert "activations.0.weight" in names
    else:
        assert meta["format_version"] == "2" and header_arch["activation"] == activation
        assert not any(n.startswith("activations.") for n in names)
    loaded = load_expert(path, expected_sha256=written.sha256)
    frozen = load_frozen_expert(path)
    assert loaded.arch == frozen.arch == arch
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(4)) * 2
    want = _reference(safetensors.torch.load_file(path), activation, x)
    with torch.inference_mode():
        got_module, got_frozen = loaded(x), frozen(x)
    torch.testing.assert_close(got_module.double(), want, rtol=1e-5, atol=1e-5)
    # The serving path's functional forward is the module's, op for op.
    assert torch.equal(got_frozen, got_module)


def test_an_old_header_reads_as_prelu(tmp_path: Path) -> None:
    # Exactly what a file written before `activation` existed carries.
    expert = ExpertMLP(ExpertArch(widths=(3, 8, 2)), generator=torch.Generator().manual_seed(1))
    state = {k: v.clone() for k, v in expert.state_dict().items()}
    old_arch = '{"batchnorm":false,"prelu_init":0.25,"widths":[3,8,2]}'
    path = tmp_path / "old.safetensors"
    safetensors.torch.save_file(state, path, metadata={"format_version": "1", "arch": old_arch})
    loaded = load_expert(path)
    assert loaded.arch.activation == "prelu" and loaded.arch == expert.arch
    x = torch.randn(10, 3)
    assert torch.equal(loaded(x), expert.eval()(x))
    # And a PReLU expert is still written with that very arch JSON (same bytes, same hash).
    assert expert.arch.to_json() == old_arch


@pytest.mark.parametrize(
    ("version", "arch_json", "reason"),
    [
        ("1", '{"widths":[3,8,2],"activation":"gelu"}', "format_version 1 holds PReLU"),
        ("2", '{"widths":[3,8,2],"activation":"swish"}', "activation"),
    ],
)
def test_bad_activation_headers_are_refused(
    tmp_path: Path, version: str, arch_json: str, reason: str
) -> None:
    expert = ExpertMLP(ExpertArch(widths=(3, 8, 2), activation="gelu"))
    path = tmp_path / "e.safetensors"
    safetensors.torch.save_file(
        dict(expert.state_dict()), path, metadata={"format_version": version, "arch": arch_json}
    )
    with pytest.raises(ExpertFormatError, match=reason):
        load_expert(path, expert_id=2)


def test_unknown_activation_is_refused_by_the_arch() -> None:
    with pytest.raises(ValueError, match="activation"):
        ExpertArch(widths=(2, 3, 1), activation="swish")  # type: ignore[arg-type]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_deepen_keeps_the_activation(activation: str) -> None:
    arch = ExpertArch(widths=(3, 8, 2), activation=activation)  # type: ignore[arg-type]
    expert = ExpertMLP(arch, generator=torch.Generator().manual_seed(0)).eval()
    deeper = expert.deepen(2, noise_std=0.0).eval()
    assert deeper.arch.activation == activation and deeper.arch.widths == (3, 8, 8, 8, 2)
    x = torch.randn(20, 3)
    if activation == "relu":
        # ReLU outputs are >= 0, which the new identity layers pass unchanged.
        torch.testing.assert_close(deeper(x), expert(x))
