"""DeviceLoader: an actor's file loads, and on CUDA the side stream they copy and pad on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from experts_store import ExpertArch, ExpertMLP, ExpertRef, FrozenExpert, save_expert
from server.pool._loader import DeviceLoader

pytestmark = pytest.mark.unit


class RecordingStream:
    """A stand-in for the CUDA side stream that logs what ran while it was current."""

    def __init__(self) -> None:
        self.current = False
        self.log: list[str] = []

    @contextmanager
    def using(self) -> Iterator[None]:
        self.current = True
        self.log.append("enter")
        try:
            yield
        finally:
            self.current = False
            self.log.append("exit")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def _ref(tmp_path: Path, widths: tuple[int, ...], seed: int = 3) -> tuple[ExpertRef, ExpertMLP]:
    arch = ExpertArch(widths=widths)
    expert = ExpertMLP(arch, generator=torch.Generator().manual_seed(seed)).eval()
    saved = save_expert(expert, tmp_path / "e.safetensors")
    path = str(tmp_path / "e.safetensors")
    return ExpertRef(saved.sha256, path, arch.nbytes(), 0, saved.checksum, saved.bytes), expert


def test_an_expert_padded_after_its_copy_is_padded_on_the_copy_stream_and_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Widths 10 and 20 are padded to 16 and 24 (ROW_ALIGN). The copy's device blocks belong
    # to the side stream: padded on the default stream (behind another expert's forward) and
    # dropped at once, they could be refilled by the next load's copy before the padding read
    # them, and this expert would answer with the next one's weights.
    ref, expert = _ref(tmp_path, (10, 20, 3))
    stream = RecordingStream()
    padded = FrozenExpert.aligned

    def aligned(self: FrozenExpert, align: int = 8) -> FrozenExpert:
        stream.log.append("pad on the copy stream" if stream.current else "pad elsewhere")
        return padded(self, align)

    monkeypatch.setattr(FrozenExpert, "aligned", aligned)
    loaded = DeviceLoader("cpu", copy_stream=stream).load(ref)
    assert stream.log == ["enter", "pad on the copy stream", "synchronize", "exit"]
    assert isinstance(loaded, FrozenExpert) and loaded.input_width == 16
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), expert(x), rtol=1e-6, atol=1e-6)


def test_an_expert_that_needs_no_padding_costs_no_second_wait(tmp_path: Path) -> None:
    ref, _ = _ref(tmp_path, (8, 16, 3))
    stream = RecordingStream()
    DeviceLoader("cpu", copy_stream=stream).load(ref)
    assert stream.log == ["enter", "exit"]


def test_a_cpu_loader_has_no_copy_stream(tmp_path: Path) -> None:
    ref, expert = _ref(tmp_path, (10, 20, 3))
    loaded = DeviceLoader("cpu").load(ref)
    assert isinstance(loaded, FrozenExpert) and loaded.input_width == 16
    x = torch.ones(2, 10)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), expert(x), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_expert_padded_while_the_default_stream_is_busy_keeps_its_own_weights(
    tmp_path: Path,
) -> None:
    # Two experts of one arch whose widths need padding, loaded one after the other while the
    # default stream is still busy (another expert's forward, here a spin kernel). Padded on
    # the default stream, the first one's padding ran after the second one's copy had landed
    # in the blocks the first one's copy had just given back, and served the second's weights.
    widths = (10, 300, 300, 3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref_a, expert_a = _ref(tmp_path / "a", widths)
    ref_b, expert_b = _ref(tmp_path / "b", widths, seed=4)
    loader = DeviceLoader("cuda")
    for ref in (ref_a, ref_b):  # every block either load needs, cached by the allocator
        loader.load(ref)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s of busy stream
    first, second = loader.load(ref_a), loader.load(ref_b)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32))
    with torch.inference_mode():
        for loaded, expert in ((first, expert_a), (second, expert_b)):
            assert isinstance(loaded, FrozenExpert)
            got = loaded(x.cuda()).cpu()
            torch.testing.assert_close(got, expert(x), rtol=1e-5, atol=1e-5)
