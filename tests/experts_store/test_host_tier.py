"""HostTier: an LRU of verified expert files in host memory, and the CUDA loads through it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from experts_store import (
    ExpertArch,
    ExpertChecksumError,
    ExpertMLP,
    ExpertRef,
    ExpertRefLoader,
    HostTier,
    save_expert,
)
from experts_store._host_tier import pinned_bytes

pytestmark = pytest.mark.unit


def _buf(nbytes: int, fill: int = 0) -> torch.Tensor:
    return torch.full((nbytes,), fill, dtype=torch.uint8)


def test_keeps_files_within_its_budget_dropping_the_least_recently_used() -> None:
    tier = HostTier(300)
    assert tier.put("a", _buf(100, 1)) and tier.put("b", _buf(100, 2))
    assert tier.put("c", _buf(100, 3))
    got = tier.get("a")  # a is now the most recently used: b goes first
    assert got is not None and int(got[0]) == 1
    assert tier.put("d", _buf(150, 4))
    assert "b" not in tier and "c" not in tier and {"a", "d"} <= {k for k in "abcd" if k in tier}
    assert tier.resident_bytes == 250 and len(tier) == 2
    assert (tier.stats.hits, tier.stats.evictions) == (1, 2)
    assert tier.get("b") is None and tier.stats.misses == 1


def test_a_file_larger_than_the_budget_is_not_kept_and_evicts_nothing() -> None:
    tier = HostTier(100)
    assert tier.put("a", _buf(60))
    assert not tier.put("big", _buf(101))
    assert "big" not in tier and "a" in tier and tier.resident_bytes == 60


def test_putting_a_key_again_replaces_it_without_counting_it_twice() -> None:
    tier = HostTier(100)
    tier.put("a", _buf(60, 1))
    tier.put("a", _buf(70, 2))
    got = tier.get("a")
    assert tier.resident_bytes == 70 and got is not None and int(got[0]) == 2


def test_concurrent_puts_never_exceed_the_budget() -> None:
    tier = HostTier(1_000)

    def fill(offset: int) -> None:
        for i in range(200):
            tier.put(f"{offset}-{i}", _buf(90 + i % 20))
            assert tier.resident_bytes <= 1_000

    threads = [threading.Thread(target=fill, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 0 < tier.resident_bytes <= 1_000


class _Pinned(torch.Tensor):
    """A CPU tensor that says it is pinned, as a CUDA build's pinned read does."""

    def is_pinned(self, device: object = None) -> bool:
        return True


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.Tensor._make_subclass(_Pinned, _buf(nbytes))


def test_a_pinned_file_counts_the_power_of_two_block_torch_pins_for_it() -> None:
    # torch's pinned-memory allocator rounds each block up to a power of two: counted by its
    # own size, a tier of files a little over 16 MiB pinned twice its budget.
    assert [pinned_bytes(n) for n in (0, 1, 3, 4096, 4097)] == [0, 1, 4, 4096, 8192]
    size = 2**16 + 64  # pinned in a block of 2**17
    tier = HostTier(4 * size)
    for key in "abcd":
        assert tier.put(key, _pinned(size))
    assert tier.resident_bytes == 2 * 2**17 <= tier.budget_bytes and len(tier) == 2
    assert "c" in tier and "d" in tier and tier.stats.evictions == 2
    # Under the budget by its own size, twice over it by the block it holds.
    assert not tier.put("e", _pinned(2**18 + 1))
    # Unpinned bytes count as they are.
    assert tier.put("f", _buf(4 * size)) and tier.resident_bytes == 4 * size


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        HostTier(-1)


def test_a_cpu_loader_refuses_a_host_tier() -> None:
    # On CPU the device memory is host memory: a tier would hold every expert twice.
    with pytest.raises(ValueError, match="CUDA devices only"):
        ExpertRefLoader("cpu", host_tier=HostTier(10**6))


def _ref(tmp_path: Path, seed: int) -> tuple[ExpertRef, ExpertMLP]:
    arch = ExpertArch(widths=(8, 64, 64, 4))
    expert = ExpertMLP(arch, generator=torch.Generator().manual_seed(seed)).eval()
    path = tmp_path / f"e{seed}.safetensors"
    saved = save_expert(expert, path)
    return ExpertRef(saved.sha256, str(path), arch.nbytes(), seed, saved.checksum), expert


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_load_kept_in_the_tier_needs_no_file_and_gives_the_same_expert(
    tmp_path: Path,
) -> None:
    tier = HostTier(10**7)
    loader = ExpertRefLoader("cuda", host_tier=tier)
    ref, expert = _ref(tmp_path, 0)
    x = torch.randn(5, 8)
    first = loader.load(ref)
    assert ref.sha256 in tier and tier.stats.misses == 1
    # The file is gone (or, below, corrupt): the kept, verified bytes serve the next load.
    Path(ref.path).unlink()
    again = loader.load(ref)
    assert tier.stats.hits == 1
    with torch.no_grad():
        want = expert(x)
    for loaded in (first, again):
        assert loaded.device.type == "cuda"
        assert torch.equal(loaded(x.cuda()).cpu(), first(x.cuda()).cpu())
        torch.testing.assert_close(loaded(x.cuda()).cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_kept_cuda_load_counts_the_pinned_block_it_occupies(tmp_path: Path) -> None:
    ref, _ = _ref(tmp_path, 2)
    file_bytes = Path(ref.path).stat().st_size
    tier = HostTier(10**7)
    ExpertRefLoader("cuda", host_tier=tier).load(ref)
    kept = tier.get(ref.sha256)
    assert kept is not None and kept.is_pinned() and kept.numel() == file_bytes
    assert tier.resident_bytes == pinned_bytes(file_bytes) > file_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_corrupt_file_is_refused_and_not_kept(tmp_path: Path) -> None:
    tier = HostTier(10**7)
    loader = ExpertRefLoader("cuda", host_tier=tier)
    ref, _ = _ref(tmp_path, 1)
    data = bytearray(Path(ref.path).read_bytes())
    data[-1] ^= 0xFF
    Path(ref.path).write_bytes(bytes(data))
    with pytest.raises(ExpertChecksumError):
        loader.load(ref)
    assert ref.sha256 not in tier and tier.resident_bytes == 0
