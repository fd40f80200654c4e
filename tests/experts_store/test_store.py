from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experts_store import (
    ExpertChecksumError,
    ExpertFileMissing,
    ExpertFormatError,
    ManifestError,
    Store,
    StoreExpertLoader,
    StoreNotFound,
    UnknownExpert,
)

pytestmark = pytest.mark.unit


def flip_byte(path: Path, offset: int = -5) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_flipped_byte_is_refused_naming_the_expert(store_root: Path) -> None:
    store = Store.open(store_root)
    flip_byte(store.expert_path(1))
    store.load_expert(0)
    with pytest.raises(ExpertChecksumError) as info:
        store.load_expert(1)
    assert info.value.expert_id == 1
    assert "expert 1" in str(info.value)
    assert info.value.expected == store.expert_entry(1).sha256
    problems = store.verify()
    assert [p.expert_id for p in problems] == [1]
    assert "checksum" in problems[0].message


def test_checksum_is_checked_on_first_read_only(store_root: Path) -> None:
    store = Store.open(store_root)
    store.load_expert(2)
    flip_byte(store.expert_path(2), offset=-1)
    # The name is content-addressed, so the file is trusted after one verified read; a fresh
    # Store (as after a restart) verifies again.
    store.load_expert(2)
    with pytest.raises(ExpertChecksumError):
        Store.open(store_root).load_expert(2)


def test_missing_file_is_reported_naming_the_expert(store_root: Path) -> None:
    store = Store.open(store_root)
    store.expert_path(0).unlink()
    with pytest.raises(ExpertFileMissing) as info:
        store.load_expert(0)
    assert info.value.expert_id == 0
    assert [p.expert_id for p in store.verify()] == [0]


def test_bad_header_with_matching_checksum_is_a_format_error(store_root: Path) -> None:
    # A manifest that agrees with a broken file (e.g. written by a buggy tool) still fails.
    import json

    from experts_store._format import sha256_hex

    store = Store.open(store_root)
    path = store.expert_path(1)
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    sha = sha256_hex(path.read_bytes())
    data = json.loads((store_root / "manifest.json").read_text())
    new_file = f"experts/1-{sha[:16]}.safetensors"
    path.rename(store_root / new_file)
    data["experts"][1].update(file=new_file, sha256=sha, bytes=16)
    (store_root / "manifest.json").write_text(json.dumps(data))
    store = Store.open(store_root)
    with pytest.raises(ExpertFormatError) as info:
        store.load_expert(1)
    assert info.value.expert_id == 1
    assert [p.expert_id for p in store.verify()] == [1]


def test_router_problems_are_reported_without_an_expert(store_root: Path) -> None:
    store = Store.open(store_root)
    flip_byte(store.router_path, offset=0)
    problems = store.verify()
    assert [p.expert_id for p in problems] == [None]


def test_unknown_expert(store_root: Path) -> None:
    store = Store.open(store_root)
    for bad in (-1, 3):
        with pytest.raises(UnknownExpert) as info:
            store.load_expert(bad)
        assert info.value.expert_id == bad


def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFound):
        Store.open(tmp_path / "absent")
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ManifestError):
        Store.open(tmp_path)


def test_expert_nbytes_is_the_loaded_experts_size(store_root: Path) -> None:
    store = Store.open(store_root)
    loader = StoreExpertLoader(store, "cpu")
    expert = loader.load(0)
    assert loader.nbytes(0) == expert.nbytes() == store.expert_nbytes(0)
    assert expert(torch.randn(2, 3)).shape == (2, 2)
