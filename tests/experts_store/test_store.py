from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from experts_store_helpers import make_expert, publish, stand_in_router

from experts_store import (
    ExpertArch,
    ExpertChecksumError,
    ExpertFileMissing,
    ExpertFormatError,
    Manifest,
    ManifestError,
    Store,
    StoreExpertLoader,
    StoreNotFound,
    StoreWriter,
    UnknownExpert,
)

pytestmark = pytest.mark.unit


def flip_byte(path: Path, offset: int = -5) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def replace_with_flipped(path: Path, offset: int) -> None:
    """Swap in a new file (a new inode, as a copy tool would) holding one flipped byte."""
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(bytes(raw))
    os.replace(tmp, path)


def strip_checksums(root: Path) -> None:
    """Rewrite the manifest as a writer from before fast checksums would have."""
    data = json.loads((root / "manifest.json").read_text())
    for entry in data["experts"]:
        del entry["checksum"]
    (root / "manifest.json").write_text(json.dumps(data))


def offset_in(path: Path, where: str) -> int:
    """A byte position in a safetensors file, found from its layout (not from our parser)."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    data_start = 8 + header_len
    return {
        "header_length_low": 0,
        "header_length_high": 7,
        "json_header": 8 + header_len // 2,
        "first_data_byte": data_start,
        "middle_of_data": (data_start + len(raw)) // 2,
        "last_data_byte": len(raw) - 1,
    }[where]


OFFSETS = [
    "header_length_low",
    "header_length_high",
    "json_header",
    "first_data_byte",
    "middle_of_data",
    "last_data_byte",
]


@pytest.mark.parametrize("where", OFFSETS)
@pytest.mark.parametrize("loaded_before", [False, True], ids=["first_load", "after_good_load"])
def test_a_flipped_byte_anywhere_is_refused_on_every_load(
    store_root: Path, where: str, loaded_before: bool
) -> None:
    store = Store.open(store_root)
    x = torch.randn(4, 3)
    if loaded_before:
        good = store.load_frozen(1)(x)
        assert torch.equal(store.load_frozen(1)(x), good)
    path = store.expert_path(1)
    replace_with_flipped(path, offset_in(path, where))
    with pytest.raises(ExpertChecksumError) as info:
        store.load_frozen(1)
    assert info.value.expert_id == 1
    assert "expert 1" in str(info.value)
    assert info.value.expected == store.expert_entry(1).checksum
    assert info.value.actual.startswith("xxh3_128:")
    assert info.value.actual != info.value.expected
    # Other experts still load.
    assert store.load_frozen(0)(x).shape == (4, 2)


def test_a_file_modified_in_place_after_a_good_load_is_refused(store_root: Path) -> None:
    store = Store.open(store_root)
    store.load_expert(2)
    flip_byte(store.expert_path(2), offset=-1)
    with pytest.raises(ExpertChecksumError) as info:
        store.load_expert(2)
    assert info.value.expert_id == 2


def test_the_recorded_checksum_is_an_xxh3_128_of_the_file(store_root: Path) -> None:
    store = Store.open(store_root)
    for entry in store.manifest.experts:
        raw = (store_root / entry.file).read_bytes()
        assert entry.checksum == "xxh3_128:" + xxhash.xxh3_128_hexdigest(raw)


def test_flipped_byte_is_refused_naming_the_expert(store_root: Path) -> None:
    store = Store.open(store_root)
    flip_byte(store.expert_path(1))
    store.load_expert(0)
    with pytest.raises(ExpertChecksumError) as info:
        store.load_expert(1)
    assert info.value.expert_id == 1
    assert "expert 1" in str(info.value)
    assert info.value.expected == store.expert_entry(1).checksum
    problems = store.verify()
    assert [p.expert_id for p in problems] == [1]
    assert "checksum" in problems[0].message


@pytest.mark.parametrize("where", ["header_length_high", "json_header", "middle_of_data"])
def test_entries_without_checksum_are_checked_by_sha256_on_first_read_only(
    store_root: Path, where: str
) -> None:
    strip_checksums(store_root)
    store = Store.open(store_root)
    assert store.expert_entry(2).checksum is None
    store.load_expert(2)
    flip_byte(store.expert_path(2), offset=-1)
    # The name is content-addressed, so such a file is trusted after one verified read; a
    # fresh Store (as after a restart) verifies again, by sha256.
    store.load_expert(2)
    fresh = Store.open(store_root)
    with pytest.raises(ExpertChecksumError) as info:
        fresh.load_expert(2)
    assert info.value.expert_id == 2
    assert info.value.expected == fresh.expert_entry(2).sha256
    path = fresh.expert_path(1)
    flip_byte(path, offset_in(path, where))
    with pytest.raises(ExpertChecksumError) as info:
        fresh.load_frozen(1)
    assert info.value.expert_id == 1
    assert [p.expert_id for p in fresh.verify()] == [1, 2]


def test_an_entry_without_checksum_loads_the_same_expert(store_root: Path) -> None:
    x = torch.randn(5, 3)
    before = Store.open(store_root).load_frozen(0)(x)
    strip_checksums(store_root)
    assert torch.equal(Store.open(store_root).load_frozen(0)(x), before)


def test_an_unknown_checksum_algorithm_falls_back_to_sha256(
    store_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = json.loads((store_root / "manifest.json").read_text())
    for entry in data["experts"]:
        entry["checksum"] = "future_hash:" + "ab" * 16
    (store_root / "manifest.json").write_text(json.dumps(data))
    store = Store.open(store_root)
    assert "future_hash" in caplog.text
    store.load_frozen(0)
    flip_byte(store.expert_path(1), offset=-1)
    with pytest.raises(ExpertChecksumError) as info:
        store.load_frozen(1)
    assert info.value.expected == store.expert_entry(1).sha256


def test_missing_file_is_reported_naming_the_expert(store_root: Path) -> None:
    store = Store.open(store_root)
    store.expert_path(0).unlink()
    with pytest.raises(ExpertFileMissing) as info:
        store.load_expert(0)
    assert info.value.expert_id == 0
    assert [p.expert_id for p in store.verify()] == [0]


def test_a_file_of_another_size_than_the_manifests_is_refused_unread(
    store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import experts_store._store as store_module
    from experts_store import ExpertRefLoader

    store = Store.open(store_root)
    ref = store.expert_ref(0)
    assert ref.file_bytes == store.expert_entry(0).bytes
    assert ExpertRefLoader("cpu").load(ref).nbytes() == ref.nbytes
    with open(store.expert_path(0), "r+b") as f:
        f.truncate(2**40)  # sparse: a wrong file of a terabyte, nothing written to disk
    with pytest.raises(ExpertFormatError) as info:
        ExpertRefLoader("cpu").load(ref)  # a read would take minutes, or fail to allocate
    assert info.value.expert_id == 0
    assert f"the file holds {2**40} bytes, the manifest says {ref.file_bytes}" in str(info.value)
    read: list[object] = []
    real = store_module.read_expert_bytes
    monkeypatch.setattr(store_module, "read_expert_bytes",
                        lambda path, **kw: read.append(path) or real(path, **kw))
    problems = store.verify()
    assert [(p.expert_id, p.message) for p in problems] == [
        (0, f"manifest says {ref.file_bytes} bytes, the file holds {2**40}")
    ]
    assert store.expert_path(0) not in read and len(read) == len(store.manifest.experts) - 1


def test_bad_header_with_matching_checksum_is_a_format_error(store_root: Path) -> None:
    # A manifest that agrees with a broken file (e.g. written by a buggy tool) still fails.
    from experts_store._format import sha256_hex

    store = Store.open(store_root)
    path = store.expert_path(1)
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    sha = sha256_hex(path.read_bytes())
    checksum = "xxh3_128:" + xxhash.xxh3_128_hexdigest(path.read_bytes())
    data = json.loads((store_root / "manifest.json").read_text())
    new_file = f"experts/1-{sha[:16]}.safetensors"
    path.rename(store_root / new_file)
    data["experts"][1].update(file=new_file, sha256=sha, bytes=16, checksum=checksum)
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


def test_a_store_opened_by_a_relative_path_hands_out_paths_that_hold_elsewhere(
    store_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Expert refs travel to Ray actors on other nodes, which run in another working folder.
    monkeypatch.chdir(store_root.parent)
    store = Store.open(Path(store_root.name))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = Path(store.expert_ref(0).path)
    assert path.is_absolute() and path.is_file()
    assert store.root == store_root.absolute()


class CountingPace:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_a_paced_open_reads_what_an_unpaced_one_reads(tmp_path: Path) -> None:
    root = tmp_path / "store"
    publish(root, num_experts=7)
    pace = CountingPace()
    paced = Store.open(root, pace=pace)
    plain = Store.open(root)
    assert paced.manifest == plain.manifest
    assert paced.manifest == Manifest.model_validate_json((root / "manifest.json").read_bytes())
    # Decoded, validated as a row (inside pydantic's one call over all rows, which would
    # otherwise hold the GIL for all of them), checked against the store, and seen by Store: 4
    # per expert.
    assert pace.calls == 4 * 7
    refs = CountingPace()
    by_refs = [dataclasses.astuple(ref) for ref in paced.expert_refs(refs)]
    # All of each ref, not its equality (the sha256 alone).
    assert by_refs == [dataclasses.astuple(plain.expert_ref(i)) for i in range(7)]
    assert refs.calls == 7


def test_refs_and_checks_of_rows_of_several_archs_are_each_rows_own(tmp_path: Path) -> None:
    """Rows of one arch share what is worked out once for it (their bytes, their parameter
    count); rows of different archs must not get each other's."""
    root = tmp_path / "store"
    widths = [(3, 8, 2), (3, 16, 2), (3, 8, 2), (3, 4, 4, 2)]
    with StoreWriter(root) as writer:
        for expert_id, arch in enumerate(widths):
            writer.add_expert(expert_id, make_expert(arch, seed=expert_id))
        writer.router_path.write_bytes(stand_in_router(len(widths), 3))
        writer.publish(task="regression", input_dim=3, output_dim=2, routing="tree", branching=2)
    store = Store.open(root)
    refs = store.expert_refs()
    assert [ref.nbytes for ref in refs] == [
        ExpertArch(widths=arch).nbytes() for arch in widths
    ]
    assert [dataclasses.astuple(ref) for ref in refs] == [
        dataclasses.astuple(store.expert_ref(i)) for i in range(len(widths))
    ]
    data = json.loads((root / "manifest.json").read_text())
    # The third row claims the second's parameter count: right for another arch, not its own.
    data["experts"][2]["params"] = data["experts"][1]["params"]
    (root / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="expert 2: params does not match its arch"):
        Store.open(root)


@pytest.mark.parametrize("paced", [False, True])
@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"store_version": "v", ', "not valid JSON"),
        ('{"temperature": NaN}', "NaN"),
        ("[]", "valid dictionary"),
    ],
)
def test_a_manifest_that_is_not_json_names_why(
    tmp_path: Path, paced: bool, text: str, says: str
) -> None:
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(ManifestError, match=says):
        Store.open(tmp_path, pace=CountingPace() if paced else None)


@pytest.mark.parametrize("paced", [False, True])
def test_a_bad_row_is_named_by_its_place_paced_or_not(tmp_path: Path, paced: bool) -> None:
    root = tmp_path / "store"
    publish(root, num_experts=3)
    data = json.loads((root / "manifest.json").read_text())
    data["experts"][1]["sha256"] = "F" * 64
    (root / "manifest.json").write_text(json.dumps(data, indent=2))
    with pytest.raises(ManifestError, match=r"experts\.1\.sha256") as info:
        Store.open(root, pace=CountingPace() if paced else None)
    assert "[0-9a-f]{64}" in str(info.value)


def _rewrite(root: Path, **fields: object) -> None:
    data = json.loads((root / "manifest.json").read_text())
    data.update(fields)
    (root / "manifest.json").write_text(json.dumps(data))


def _swap_router(root: Path, content: bytes) -> None:
    """Put `content` in as the router, named by its own hash as the writer names one."""
    import hashlib

    name = f"router-{hashlib.sha256(content).hexdigest()[:16]}.safetensors"
    (root / name).write_bytes(content)
    _rewrite(root, router_file=name)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("manifest is a directory", "cannot read manifest.json"),
        ("manifest is a FIFO", "cannot read manifest.json: not a regular file"),  # was a hang
        ("nested too deeply", "nested too deeply"),
        ("format 99", "format_version 99"),
        ("format 0", "format_version 0"),
        ("an id of true", "experts.1.id"),
        ("an id of '1'", "experts.1.id"),
        ("num_experts 10^12", "0..999999999999"),
    ],
)
def test_a_manifest_momlp_cannot_read_is_a_manifest_error(
    store_root: Path, case: str, words: str
) -> None:
    # Each was a traceback (IsADirectoryError, RecursionError, MemoryError) or was accepted.
    manifest = store_root / "manifest.json"
    data = json.loads(manifest.read_text())
    if case == "manifest is a directory":
        manifest.unlink()
        manifest.mkdir()
    elif case == "manifest is a FIFO":
        manifest.unlink()
        os.mkfifo(manifest)
    elif case == "nested too deeply":
        data["extra"] = None
        deep = "[" * 10**5 + "]" * 10**5
        manifest.write_text(json.dumps(data).replace('"extra": null', f'"extra": {deep}'))
    elif case.startswith("format"):
        _rewrite(store_root, format_version=int(case.split()[1]))
    elif case.startswith("an id"):
        data["experts"][1]["id"] = True if "true" in case else "1"
        manifest.write_text(json.dumps(data))
    else:
        _rewrite(store_root, num_experts=10**12)
    with pytest.raises(ManifestError) as info:
        Store.open(store_root)
    assert words in str(info.value), str(info.value)
    # One line (`momlp serve` prints it as the reason it did not start), no pydantic boilerplate.
    assert "\n" not in str(info.value) and "pydantic" not in str(info.value), str(info.value)


def test_verify_reads_the_router_as_the_server_would(store_root: Path) -> None:
    # Each of these stores verified "ok" and then failed to start (or served nothing).
    from safetensors.torch import save

    store = Store.open(store_root)
    assert store.verify() == []
    cases = {
        b"not a safetensors file at all": "not a readable router",
        save({"weights": torch.zeros(3, 3)}): "no 2-D float32 prototypes",
        save({"prototypes": torch.zeros(3, 5)}): "3 prototypes of dimension 5, the manifest has "
        "3 experts of input_dim 3",
        save({"prototypes": torch.zeros(4, 3)}): "4 prototypes",
    }
    for content, words in cases.items():
        _swap_router(store_root, content)
        problems = Store.open(store_root).verify()
        assert [p.expert_id for p in problems] == [None], words
        assert words in problems[0].message
    router = store_root / Store.open(store_root).manifest.router_file  # type: ignore[operator]
    router.unlink()
    router.mkdir()
    problems = Store.open(store_root).verify()
    assert "not a regular file" in problems[0].message
    router.rmdir()
    os.mkfifo(router)  # its read blocked `verify` for good
    problems = Store.open(store_root).verify()
    assert [p.message for p in problems] == [f"router file {router.name}: not a regular file"]


def test_verify_names_a_kind_momlp_does_not_serve(store_root: Path) -> None:
    _rewrite(store_root, kind="wizard")
    problems = Store.open(store_root).verify()
    assert [p.expert_id for p in problems] == [None]
    assert "store kind 'wizard'" in problems[0].message


def test_verify_names_an_expert_whose_byte_count_is_not_its_files(store_root: Path) -> None:
    data = json.loads((store_root / "manifest.json").read_text())
    data["experts"][1]["bytes"] = 10**40
    (store_root / "manifest.json").write_text(json.dumps(data))
    problems = Store.open(store_root).verify()
    assert [p.expert_id for p in problems] == [1]
    assert f"manifest says {10**40} bytes" in problems[0].message
