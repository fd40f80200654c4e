from __future__ import annotations

import pytest
import torch

from experts_store import ExpertArch, ExpertMLP

pytestmark = pytest.mark.unit


def reference_forward(expert: ExpertMLP, x: torch.Tensor) -> torch.Tensor:
    """Eq. (2) written out from the state dict, in float64."""
    state = {k: v.double() for k, v in expert.state_dict().items()}
    layers = len(expert.arch.widths) - 1
    h = x.double()
    for j in range(layers):
        h = h @ state[f"linears.{j}.weight"].T + state[f"linears.{j}.bias"]
        if j == layers - 1:
            return h
        if expert.arch.batchnorm:
            mean, var = state[f"norms.{j}.running_mean"], state[f"norms.{j}.running_var"]
            h = (h - mean) / torch.sqrt(var + 1e-5) * state[f"norms.{j}.weight"]
            h = h + state[f"norms.{j}.bias"]
        gamma = state[f"activations.{j}.weight"]
        h = torch.where(h >= 0, h, gamma * h)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("batchnorm", [False, True])
def test_forward_is_equation_2(batchnorm: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    expert = ExpertMLP(ExpertArch(widths=(4, 16, 9, 3), batchnorm=batchnorm), generator=gen)
    with torch.no_grad():
        for p in expert.activations.parameters():
            p.uniform_(-0.5, 1.5, generator=gen)
    expert.eval()
    x = torch.randn(64, 4, generator=gen)
    torch.testing.assert_close(
        expert(x).double(), reference_forward(expert, x), rtol=1e-5, atol=1e-5
    )


def test_prelu_init_zero_is_relu() -> None:
    expert = ExpertMLP(ExpertArch(widths=(2, 6, 1), prelu_init=0.0))
    assert torch.all(expert.activations[0].weight == 0)
    x = torch.randn(10, 2)
    hidden = torch.relu(expert.linears[0](x))
    torch.testing.assert_close(expert(x), expert.linears[1](hidden))


def test_generator_makes_init_reproducible() -> None:
    arch = ExpertArch(widths=(3, 8, 2))
    a = ExpertMLP(arch, generator=torch.Generator().manual_seed(5))
    b = ExpertMLP(arch, generator=torch.Generator().manual_seed(5))
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(ta, tb), name


def test_meta_device_builds_a_skeleton_without_storage() -> None:
    expert = ExpertMLP(ExpertArch(widths=(3, 4096, 4096, 2)), device="meta")
    assert all(p.device.type == "meta" for p in expert.parameters())


def test_deepen_without_noise_preserves_the_function_exactly() -> None:
    gen = torch.Generator().manual_seed(2)
    expert = ExpertMLP(ExpertArch(widths=(3, 12, 7, 2), prelu_init=0.25), generator=gen)
    deeper = expert.deepen(3, noise_std=0.0)
    assert deeper.arch.widths == (3, 12, 7, 7, 7, 7, 2)
    assert deeper.num_parameters() == deeper.arch.num_parameters()
    x = torch.randn(256, 3, generator=gen) * 3
    assert torch.equal(deeper(x), expert(x))


def test_deepen_with_batchnorm_preserves_the_eval_function() -> None:
    gen = torch.Generator().manual_seed(3)
    expert = ExpertMLP(ExpertArch(widths=(3, 12, 7, 2), batchnorm=True), generator=gen)
    expert.train()
    expert(torch.randn(64, 3, generator=gen))
    expert.eval()
    deeper = expert.deepen(2, noise_std=0.0).eval()
    x = torch.randn(128, 3, generator=gen)
    torch.testing.assert_close(deeper(x), expert(x), rtol=1e-6, atol=1e-6)


def test_deepen_changes_outputs_less_than_the_noise_implies() -> None:
    gen = torch.Generator().manual_seed(4)
    expert = ExpertMLP(ExpertArch(widths=(3, 32, 32, 2)), generator=gen)
    noise_std, extra = 1e-3, 2
    deeper = expert.deepen(extra, noise_std=noise_std, generator=gen)
    x = torch.randn(512, 3, generator=gen)
    with torch.no_grad():
        change = (deeper(x) - expert(x)).norm(dim=1)
        hidden = x
        for j in range(2):
            hidden = expert.activations[j](expert.linears[j](hidden))
        # The new layers are exactly linear (γ = 1), so the output moves by
        # A_J (Π(I + E_l) − I) x_J, bounded through operator norms of the actual noise.
        eye = torch.eye(32)
        norms = [
            torch.linalg.matrix_norm(deeper.linears[2 + i].weight - eye, ord=2)
            for i in range(extra)
        ]
        growth = torch.prod(torch.stack([1 + n for n in norms])) - 1
        bound = torch.linalg.matrix_norm(expert.linears[2].weight, ord=2) * growth
        bound = bound * hidden.norm(dim=1)
    assert torch.all(change <= bound * 1.001 + 1e-6)
    assert change.max() > 0
    # The noise itself is about noise_std · (2√width) in operator norm, nothing larger.
    assert max(float(n) for n in norms) < 4 * noise_std * 32**0.5
    assert torch.all(deeper.activations[2].weight == 1)
