"""FrozenExpert: the serving form of an expert computes exactly what the ExpertMLP does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from experts_store_helpers import make_expert, publish

from experts_store import (
    ExpertArch,
    ExpertChecksumError,
    ExpertMLP,
    FrozenExpert,
    Store,
    load_frozen_expert,
    save_expert,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("batchnorm", [False, True])
@pytest.mark.parametrize("widths", [(5, 3), (5, 32, 3), (7, 32, 16, 64, 2)])
def test_outputs_are_bit_identical_to_the_eval_mode_module(
    tmp_path: Path, widths: tuple[int, ...], batchnorm: bool
) -> None:
    expert = make_expert(widths, batchnorm=batchnorm, seed=3)
    # γ away from its init, so a PReLU that ignored γ would show.
    with torch.no_grad():
        for activation in expert.activations:
            activation.weight.uniform_(-0.5, 0.9)
    path = tmp_path / "e.safetensors"
    written = save_expert(expert, path)
    frozen = load_frozen_expert(path, expected_sha256=written.sha256, expert_id=1)
    x = torch.randn(50, widths[0]) * 3
    with torch.inference_mode():
        assert torch.equal(frozen(x), expert(x))
        assert torch.equal(FrozenExpert.from_module(expert)(x), expert(x))
    assert frozen.arch == expert.arch
    # Everything but BatchNorm's num_batches_tracked counters (one int64 each), unused in eval.
    assert frozen.nbytes() == expert.nbytes() - 8 * len(expert.norms)
    assert frozen.device == torch.device("cpu")


def test_a_deepened_expert_with_batchnorm_serves_like_its_module(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    small = ExpertMLP(ExpertArch(widths=(4, 16, 2), batchnorm=True), generator=gen).eval()
    deep = small.deepen(2, noise_std=1e-2, generator=gen).eval()
    path = tmp_path / "deep.safetensors"
    save_expert(deep, path)
    x = torch.randn(20, 4)
    with torch.inference_mode():
        assert torch.equal(load_frozen_expert(path)(x), deep(x))


def test_the_store_checks_a_frozen_load_like_any_other(tmp_path: Path) -> None:
    publish(tmp_path / "s", num_experts=2)
    store = Store.open(tmp_path / "s")
    frozen = store.load_frozen(1)
    module = store.load_expert(1)
    x = torch.randn(6, 3)
    with torch.inference_mode():
        assert torch.equal(frozen(x), module(x))
    path = store.root / store.expert_entry(0).file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ExpertChecksumError) as info:
        Store.open(tmp_path / "s").load_frozen(0)
    assert info.value.expert_id == 0


def test_from_module_refuses_a_module_that_is_not_an_expert() -> None:
    with pytest.raises(TypeError, match="ExpertMLP"):
        FrozenExpert.from_module(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batchnorm", [False, True])
def test_cuda_frozen_expert_through_pinned_memory(tmp_path: Path, batchnorm: bool) -> None:
    expert = make_expert((5, 32, 16, 3), batchnorm=batchnorm, seed=8)
    path = tmp_path / "e.safetensors"
    written = save_expert(expert, path)
    frozen = load_frozen_expert(path, "cuda", expected_sha256=written.sha256, expert_id=0)
    assert frozen.device.type == "cuda"
    x = torch.randn(10, 5)
    with torch.inference_mode():
        torch.testing.assert_close(frozen(x.cuda()).cpu(), expert(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["prelu", "sigmoid", "gelu"])
def test_aligned_expert_computes_the_same_function_with_padded_widths(activation: str) -> None:
    torch.manual_seed(3)
    arch = ExpertArch(widths=(3, 10, 5, 2), batchnorm=True, activation=activation)  # type: ignore[arg-type]
    frozen = FrozenExpert.from_module(ExpertMLP(arch).eval())
    aligned = frozen.aligned()
    assert aligned.arch == arch and aligned.input_width == 8
    assert aligned.nbytes() > frozen.nbytes()
    x = torch.randn(20, 3)
    with torch.inference_mode():
        want = frozen(x)
        # Unpadded and padded inputs alike; sigmoid(0) = 0.5 of a padded unit adds nothing.
        for got in (aligned(x), aligned(torch.nn.functional.pad(x, (0, 5)))):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    already = FrozenExpert.from_module(ExpertMLP(ExpertArch(widths=(8, 16, 3))).eval())
    assert already.aligned() is already
