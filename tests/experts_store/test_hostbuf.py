from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from experts_store_helpers import make_expert

import experts_store._format as format_module
from experts_store import HostBufferPool, load_expert, save_expert

pytestmark = pytest.mark.unit

# (64, 760, 760, 64) float32: about 2.6 MiB; the tests lower the 4 MiB threshold above which
# loads use the pool (or fresh huge-page mappings) to keep files small.
LARGE = (64, 760, 760, 64)


@pytest.fixture(autouse=True)
def small_large_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_module, "_HUGE_PAGE_MIN_BYTES", 1024 * 1024)


def test_freed_buffers_are_reused_and_bounded() -> None:
    pool = HostBufferPool(max_bytes=4 * 1024 * 1024)
    first = pool.take(3_000_000)
    assert first.numel() == 3_000_000 and first.dtype == torch.uint8
    view = first[8:].view(torch.float32)
    del first
    assert pool.free_bytes == 0  # a view still holds it
    del view
    assert pool.free_bytes == 4 * 1024 * 1024
    again = pool.take(3_500_000)
    assert (pool.reused, pool.created) == (1, 1)
    other = pool.take(3_500_000)
    assert pool.created == 2
    del again, other
    gc.collect()
    # Only one 4 MiB buffer fits under max_bytes; the other was unmapped.
    assert pool.free_bytes == 4 * 1024 * 1024
    pool.clear()
    assert pool.free_bytes == 0


def test_large_experts_round_trip_through_pooled_buffers(tmp_path: Path) -> None:
    pool = HostBufferPool(max_bytes=64 * 1024 * 1024)
    experts = [make_expert(LARGE, seed=s) for s in range(3)]
    paths = [tmp_path / f"{s}.safetensors" for s in range(3)]
    for expert, path in zip(experts, paths, strict=True):
        save_expert(expert, path)
    x = torch.randn(16, 64)
    kept = load_expert(paths[0], host_pool=pool)
    for _ in range(2):
        for expert, path in zip(experts[1:], paths[1:], strict=True):
            loaded = load_expert(path, host_pool=pool)
            assert torch.equal(loaded(x), expert(x))
            del loaded
    # Buffers were recycled, yet the expert still alive kept its own bytes.
    assert pool.reused >= 3
    assert torch.equal(kept(x), experts[0](x))


def test_fresh_huge_page_buffers_round_trip(tmp_path: Path) -> None:
    expert = make_expert(LARGE, batchnorm=True, seed=3)
    path = tmp_path / "e.safetensors"
    written = save_expert(expert, path)
    loaded = load_expert(path, expected_sha256=written.sha256)
    x = torch.randn(8, 64)
    assert torch.equal(loaded(x), expert(x))
