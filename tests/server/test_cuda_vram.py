"""On a CUDA actor a request's VRAM figure is its own: neither cuBLAS's workspace nor an
expert that another thread loads meanwhile is in it.

cuBLAS allocates a workspace (34.6 MB on an H100 with torch 2.11) on the first GEMM a thread
runs and keeps it. Before the actor ran a throwaway block first, the first request on each
thread reported that workspace as its activation bytes (benchmarks/RESULTS.md, "The first GPU
session"). Needs a GPU: `pytest -m gpu` (benchmarks/gpu_session.sh runs it).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from experts_store import ExpertArch, ExpertMLP, ExpertRef, save_expert
from server.pool import ActorCore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _ref(tmp_path: Path, widths: tuple[int, ...] = (16, 256, 256, 8)) -> ExpertRef:
    arch = ExpertArch(widths=widths)
    torch.manual_seed(0)
    path = tmp_path / f"e-{'-'.join(map(str, widths))}.safetensors"
    saved = save_expert(ExpertMLP(arch).eval(), path)
    return ExpertRef(saved.sha256, str(path), arch.nbytes(), 0, saved.checksum)


def _activation(core: ActorCore, ref: ExpertRef, rows: np.ndarray) -> int:
    outcome = core.run([(ref, rows)]).results[0]
    assert outcome.error is None, outcome.error
    return outcome.activation_bytes


def test_first_request_on_each_thread_reports_the_same_vram_as_later_ones(
    tmp_path: Path,
) -> None:
    ref = _ref(tmp_path)
    rows = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    core = ActorCore(name="a0", device="cuda", budget_bytes=10**8)
    try:
        first = _activation(core, ref, rows)
        later = _activation(core, ref, rows)
        # A 64-row block through 16-256-256-8 needs well under a megabyte of activations.
        assert 0 < first == later < 2**20
        # A thread of its own gets a workspace of its own: still not in the figure.
        seen: list[int] = []
        other = threading.Thread(target=lambda: seen.append(_activation(core, ref, rows)))
        other.start()
        other.join()
        assert seen == [later]
    finally:
        core.close()


def test_an_expert_loaded_on_the_look_ahead_thread_is_not_in_the_figure(tmp_path: Path) -> None:
    small, large = _ref(tmp_path), _ref(tmp_path, (16, 2048, 2048, 16))  # large: ~17 MB
    rows = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    alone = ActorCore(name="a0", device="cuda", budget_bytes=10**8)
    try:
        clean = _activation(alone, small, rows)
    finally:
        alone.close()
    core = ActorCore(name="a1", device="cuda", budget_bytes=10**8, lookahead=True)
    try:
        # The look-ahead loads `large` while `small` computes for the first time.
        reply = core.run([(small, rows), (large, rows)])
        first, second = reply.results
        assert first.error is None and second.error is None
        assert not second.hit
        assert first.activation_bytes == clean
        assert 0 < second.activation_bytes < large.nbytes
    finally:
        core.close()
