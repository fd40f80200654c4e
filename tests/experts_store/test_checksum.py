from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import xxhash
from experts_store_helpers import make_expert

from experts_store import (
    ExpertChecksumError,
    ExpertFormatError,
    HostBufferPool,
    StoreWriter,
    load_expert,
    load_frozen_expert,
    save_expert,
)
from experts_store._load import read_expert_state

pytestmark = pytest.mark.unit

# Larger than one read chunk and than the host pool's threshold, so that the checksum is
# computed over several chunks into a pooled buffer.
BIG_WIDTHS = (64, 1100, 1100, 64)


def xxh3_of(path: Path) -> str:
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(path.read_bytes())


def flipped(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x80
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("widths", [(3, 8, 2), BIG_WIDTHS], ids=["small", "big"])
def test_save_records_the_xxh3_128_of_the_file(tmp_path: Path, widths: tuple[int, ...]) -> None:
    path = tmp_path / "e.safetensors"
    written = save_expert(make_expert(widths), path)
    assert path.stat().st_size > (4 << 20 if widths == BIG_WIDTHS else 0)
    assert written.checksum == xxh3_of(path)
    assert written.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("widths", [(3, 8, 2), BIG_WIDTHS], ids=["small", "big"])
def test_a_matching_checksum_loads_the_same_expert(tmp_path: Path, widths: tuple[int, ...]) -> None:
    expert = make_expert(widths, seed=3)
    path = tmp_path / "e.safetensors"
    written = save_expert(expert, path)
    pool = HostBufferPool(64 << 20)
    loaded = load_expert(path, expected_checksum=written.checksum, expert_id=5, host_pool=pool)
    frozen = load_frozen_expert(path, expected_checksum=written.checksum, host_pool=pool)
    x = torch.randn(7, widths[0])
    with torch.inference_mode():
        assert torch.equal(loaded(x), expert(x))
        assert torch.equal(frozen(x), expert(x))


@pytest.mark.parametrize("widths", [(3, 8, 2), BIG_WIDTHS], ids=["small", "big"])
@pytest.mark.parametrize("where", [0, 7, 40, -1, "middle"])
def test_a_flipped_byte_fails_the_checksum_naming_the_expert(
    tmp_path: Path, widths: tuple[int, ...], where: int | str
) -> None:
    path = tmp_path / "e.safetensors"
    written = save_expert(make_expert(widths), path)
    assert written.checksum is not None
    flipped(path, path.stat().st_size // 2 if where == "middle" else int(where))
    pool = HostBufferPool(64 << 20)
    for load in (load_expert, load_frozen_expert, read_expert_state):
        with pytest.raises(ExpertChecksumError) as info:
            load(path, expected_checksum=written.checksum, expert_id=9, host_pool=pool)
        assert info.value.expert_id == 9
        assert "expert 9" in str(info.value)
        assert "xxh3_128" in str(info.value)
        assert info.value.expected == written.checksum
        assert info.value.actual == xxh3_of(path)


def test_sha256_and_checksum_are_both_checked_when_both_given(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    written = save_expert(make_expert(), path)
    assert written.checksum is not None
    load_expert(path, expected_sha256=written.sha256, expected_checksum=written.checksum)
    with pytest.raises(ExpertChecksumError) as info:
        load_expert(path, expected_sha256="0" * 64, expected_checksum=written.checksum)
    assert info.value.expected == "0" * 64
    with pytest.raises(ExpertChecksumError) as info:
        load_expert(path, expected_sha256=written.sha256, expected_checksum="xxh3_128:" + "0" * 32)
    assert info.value.expected == "xxh3_128:" + "0" * 32


@pytest.mark.parametrize("bad", ["md5:" + "0" * 32, "0" * 32, "XXH3_128:" + "0" * 32, ""])
def test_an_unknown_checksum_algorithm_is_a_format_error(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "e.safetensors"
    save_expert(make_expert(), path)
    with pytest.raises(ExpertFormatError) as info:
        load_frozen_expert(path, expected_checksum=bad, expert_id=4)
    assert info.value.expert_id == 4
    assert "expert 4" in str(info.value)
    assert "checksum" in str(info.value)


def test_the_writer_records_the_checksum_of_files_tasks_wrote(tmp_path: Path) -> None:
    with StoreWriter(tmp_path / "store") as writer:
        written = save_expert(make_expert(BIG_WIDTHS), writer.expert_path(0))
        entry = writer.register_expert_file(0)
        assert entry.checksum == written.checksum == xxh3_of(writer.expert_path(0))
        assert entry.sha256 == written.sha256
        added = writer.add_expert(1, make_expert(seed=1))
        assert added.checksum == xxh3_of(writer.expert_path(1))
