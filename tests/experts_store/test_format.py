from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from experts_store_helpers import make_expert

from experts_store import (
    ExpertChecksumError,
    ExpertFileMissing,
    ExpertFormatError,
    ExpertLoadError,
    StoreWriteError,
    load_expert,
    load_frozen_expert,
    save_expert,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("batchnorm", [False, True])
def test_round_trip_gives_bit_identical_outputs(tmp_path: Path, batchnorm: bool) -> None:
    expert = make_expert((5, 32, 16, 3), batchnorm=batchnorm, seed=7)
    path = tmp_path / "e.safetensors"
    written = save_expert(expert, path)
    loaded = load_expert(path, expected_sha256=written.sha256, expert_id=4)
    assert not loaded.training
    assert loaded.arch == expert.arch
    for name, tensor in expert.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    if batchnorm:
        # Running statistics moved during the fake training must survive the trip.
        assert not torch.all(loaded.norms[0].running_mean == 0)
    x = torch.randn(100, 5)
    assert torch.equal(loaded(x), expert(x))
    assert written.bytes == path.stat().st_size
    assert written.params == expert.num_parameters()


def test_files_are_plain_safetensors_with_arch_metadata(tmp_path: Path) -> None:
    expert = make_expert((3, 8, 2))
    path = tmp_path / "e.safetensors"
    save_expert(expert, path, metadata={"note": "hello"})
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == set(expert.state_dict())
    assert meta["format_version"] == "1"
    assert json.loads(meta["arch"])["widths"] == [3, 8, 2]
    assert meta["note"] == "hello"
    tensors = safetensors.torch.load_file(path)
    for name, tensor in expert.state_dict().items():
        assert torch.equal(tensors[name], tensor)


def test_reserved_metadata_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        save_expert(make_expert(), tmp_path / "e.safetensors", metadata={"arch": "x"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_that_are_not_numbers_are_refused_before_anything_is_written(
    tmp_path: Path, value: float
) -> None:
    expert = make_expert()
    with torch.no_grad():
        expert.linears[1].weight[0, 0] = value
    with pytest.raises(StoreWriteError) as info:
        save_expert(expert, tmp_path / "e.safetensors")
    assert info.value.reason == (
        "linears.1.weight holds NaN or infinite values (did its training diverge?)"
    )
    assert list(tmp_path.iterdir()) == []


def test_loaded_expert_can_be_saved_again_unchanged(tmp_path: Path) -> None:
    first = save_expert(make_expert(batchnorm=True), tmp_path / "a.safetensors")
    loaded = load_expert(tmp_path / "a.safetensors")
    second = save_expert(loaded, tmp_path / "b.safetensors")
    assert second.sha256 == first.sha256


def test_checksum_mismatch_names_the_expert(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    save_expert(make_expert(), path)
    with pytest.raises(ExpertChecksumError) as info:
        load_expert(path, expected_sha256="0" * 64, expert_id=9)
    assert info.value.expert_id == 9
    assert "expert 9" in str(info.value)


def test_missing_file_names_the_expert(tmp_path: Path) -> None:
    with pytest.raises(ExpertFileMissing) as info:
        load_expert(tmp_path / "nope.safetensors", expert_id=2)
    assert info.value.expert_id == 2


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    return path


def _valid(
    expert_widths: tuple[int, ...] = (3, 8, 2),
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    expert = make_expert(expert_widths)
    state = {k: v.clone() for k, v in expert.state_dict().items()}
    return state, {"format_version": "1", "arch": expert.arch.to_json()}


def test_wrong_dtype_is_a_format_error(tmp_path: Path) -> None:
    state, meta = _valid()
    state["linears.0.weight"] = state["linears.0.weight"].double()
    path = _write(tmp_path / "e.safetensors", state, meta)
    with pytest.raises(ExpertFormatError, match="dtype") as info:
        load_expert(path, expert_id=1)
    assert info.value.expert_id == 1


def test_wrong_shape_is_a_format_error(tmp_path: Path) -> None:
    state, meta = _valid()
    state["linears.1.weight"] = torch.zeros(2, 9)
    path = _write(tmp_path / "e.safetensors", state, meta)
    with pytest.raises(ExpertFormatError, match="shape"):
        load_expert(path, expert_id=1)


def test_missing_tensor_is_a_format_error(tmp_path: Path) -> None:
    state, meta = _valid()
    del state["activations.0.weight"]
    path = _write(tmp_path / "e.safetensors", state, meta)
    with pytest.raises(ExpertFormatError, match="missing"):
        load_expert(path, expert_id=1)


@pytest.mark.parametrize(
    "metadata",
    [
        {},
        {"format_version": "3", "arch": '{"widths": [3, 8, 2]}'},
        {"format_version": "1"},
        {"format_version": "1", "arch": "{not json"},
        {"format_version": "1", "arch": '{"widths": [3, 9, 2]}'},
    ],
)
def test_bad_metadata_is_a_format_error(tmp_path: Path, metadata: dict[str, str]) -> None:
    state, _ = _valid()
    path = _write(tmp_path / "e.safetensors", state, metadata)
    with pytest.raises(ExpertFormatError) as info:
        load_expert(path, expert_id=6)
    assert info.value.expert_id == 6


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"abc",
        struct.pack("<Q", 10**12) + b"{}",
        struct.pack("<Q", 4) + b"[1] ",
        # A header of nested arrays: RecursionError, which failed the actor's whole call.
        struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=["empty", "short", "header-bomb", "list", "nested"],
)
def test_garbage_files_are_format_errors(tmp_path: Path, payload: bytes) -> None:
    path = tmp_path / "e.safetensors"
    path.write_bytes(payload)
    with pytest.raises(ExpertFormatError):
        load_expert(path, expert_id=0)


def test_data_offsets_outside_the_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    save_expert(make_expert(), path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-4])
    with pytest.raises(ExpertFormatError, match="offsets"):
        load_expert(path, expert_id=0)


def test_unreadable_path_is_a_load_error_naming_the_expert(tmp_path: Path) -> None:
    with pytest.raises(ExpertLoadError) as info:
        load_expert(tmp_path, expert_id=5)
    assert info.value.expert_id == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batchnorm", [False, True])
def test_cuda_round_trip_through_pinned_memory(tmp_path: Path, batchnorm: bool) -> None:
    expert = make_expert((5, 32, 16, 3), batchnorm=batchnorm, seed=8)
    path = tmp_path / "e.safetensors"
    written = save_expert(expert, path)
    loaded = load_expert(path, "cuda", expected_sha256=written.sha256, expert_id=0)
    assert all(t.device.type == "cuda" for t in loaded.state_dict().values())
    for name, tensor in expert.state_dict().items():
        assert torch.equal(loaded.state_dict()[name].cpu(), tensor), name
    x = torch.randn(10, 5)
    torch.testing.assert_close(loaded(x.cuda()).cpu(), expert(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pad", [1, 2, 3])
def test_a_file_whose_tensors_start_unaligned_loads_the_same_expert(
    tmp_path: Path, pad: int
) -> None:
    # save_expert pads the header to 8 bytes; another writer need not. A header longer by
    # 1-3 bytes moves every tensor off its 4-byte alignment (the loader copies those).
    expert = make_expert((5, 32, 16, 3), seed=3)
    path = tmp_path / "e.safetensors"
    save_expert(expert, path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + length] + b" " * pad  # trailing blanks: still the same JSON
    moved = tmp_path / "moved.safetensors"
    moved.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])
    for loaded in (load_expert(moved), load_frozen_expert(moved)):
        x = torch.randn(20, 5)
        assert torch.equal(loaded(x), expert(x))
