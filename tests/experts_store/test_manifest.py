from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from experts_store import ExpertArch, ExpertEntry, Manifest, UnknownExpert
from experts_store._manifest import expert_file_name

pytestmark = pytest.mark.unit


def manifest_dict(store_root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((store_root / "manifest.json").read_text())
    return data


def test_published_manifest_has_the_design_keys(store_root: Path) -> None:
    data = manifest_dict(store_root)
    for key in (
        "format_version",
        "store_version",
        "task",
        "input_dim",
        "output_dim",
        "routing",
        "branching",
        "num_experts",
        "experts",
        "created_at",
        "temperature",
        "router_file",
        "extra",
    ):
        assert key in data
    assert set(data["experts"][0]) == {
        "id",
        "file",
        "sha256",
        "bytes",
        "params",
        "arch",
        "checksum",
    }
    manifest = Manifest.model_validate(data)
    assert manifest.total_expert_bytes == sum(e["bytes"] for e in data["experts"])
    assert manifest.expert(2).id == 2
    with pytest.raises(UnknownExpert) as info:
        manifest.expert(3)
    assert info.value.expert_id == 3


@pytest.mark.parametrize(
    "bad_file",
    [
        "/etc/passwd",
        "../experts/0-0123456789abcdef.safetensors",
        "experts/../../x.safetensors",
        "experts/1-{sha}.safetensors",
        "experts/0-{sha}.pkl",
        "experts/0.safetensors",
    ],
)
def test_file_paths_must_be_the_derived_names(store_root: Path, bad_file: str) -> None:
    data = manifest_dict(store_root)
    data["experts"][0]["file"] = bad_file.format(sha=data["experts"][0]["sha256"][:16])
    with pytest.raises(ValidationError):
        Manifest.model_validate(data)


@pytest.mark.parametrize("ids", [[0, 1, 1], [1, 2, 3], [0, 2, 1]])
def test_ids_must_be_exactly_zero_to_k_minus_one(store_root: Path, ids: list[int]) -> None:
    data = manifest_dict(store_root)
    for entry, new_id in zip(data["experts"], ids, strict=True):
        sha = entry["sha256"]
        entry["id"], entry["file"] = new_id, f"experts/{new_id}-{sha[:16]}.safetensors"
    with pytest.raises(ValidationError, match="0..2"):
        Manifest.model_validate(data)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("router_file", "../router-0123456789abcdef.safetensors"),
        ("task", "ranking"),
        ("routing", "random"),
        ("num_experts", 4),
        ("input_dim", 5),
        ("store_version", "a/b"),
    ],
)
def test_other_fields_are_validated(store_root: Path, key: str, value: object) -> None:
    data = manifest_dict(store_root)
    data[key] = value
    with pytest.raises(ValidationError):
        Manifest.model_validate(data)


def test_entry_arch_must_agree_with_params(store_root: Path) -> None:
    data = manifest_dict(store_root)
    data["experts"][1]["params"] += 1
    with pytest.raises(ValidationError, match="params"):
        Manifest.model_validate(data)


def test_a_momlp_row_must_map_the_stores_dims(store_root: Path) -> None:
    data = manifest_dict(store_root)
    # A consistent row (its params are its arch's) of an arch that takes 4 columns, not 3.
    arch = ExpertArch(widths=(4, 8, 2))
    data["experts"][1]["arch"], data["experts"][1]["params"] = arch.to_dict(), arch.num_parameters()
    with pytest.raises(ValidationError, match=r"expert 1: arch maps 4 -> 2, store maps 3 -> 2"):
        Manifest.model_validate(data)


def test_a_manifest_without_checksums_still_loads(store_root: Path) -> None:
    data = manifest_dict(store_root)
    for entry in data["experts"]:
        del entry["checksum"]
    manifest = Manifest.model_validate(data)
    assert [e.checksum for e in manifest.experts] == [None, None, None]


@pytest.mark.parametrize(
    "bad", ["0f3a" * 8, "xxh3_128:", "xxh3_128:0F3A0F3A", "XXH3:0f3a0f3a", "xxh3 128:0f3a0f3a"]
)
def test_a_malformed_checksum_is_refused(store_root: Path, bad: str) -> None:
    data = manifest_dict(store_root)
    data["experts"][1]["checksum"] = bad
    with pytest.raises(ValidationError, match="checksum"):
        Manifest.model_validate(data)


@pytest.mark.parametrize(
    ("field", "twin"),
    [("widths", [True, 4, 2]),  # True == 1 in Python
     ("widths", [1.0, 4, 2]),  # 1.0 == 1
     ("batchnorm", 0)],  # 0 == False
)
def test_an_arch_equal_in_python_but_not_in_json_is_still_refused(
    field: str, twin: object
) -> None:
    """Archs are checked once per distinct JSON value (a K=100,000 manifest repeats one arch
    100,000 times): a value Python calls equal to a checked one is not taken for it."""
    sha = "ab" * 32
    arch = {"widths": [1, 4, 2], "batchnorm": False, "prelu_init": 0.25}
    entry = {
        "id": 0, "file": expert_file_name(0, sha), "sha256": sha, "bytes": 100,
        "params": ExpertArch(widths=(1, 4, 2)).num_parameters(), "arch": arch,
    }
    assert ExpertEntry.model_validate(entry).expert_arch == ExpertArch(widths=(1, 4, 2))
    with pytest.raises(ValidationError, match="arch"):
        ExpertEntry.model_validate({**entry, "arch": {**arch, field: twin}})


def test_entries_of_one_arch_share_its_dict_and_a_replaced_arch_is_its_own() -> None:
    """A K=100,000 manifest holds one dict per distinct arch, and each entry's arch is looked
    up by that dict; an entry whose `arch` is replaced (model_copy) reports the new one."""
    archs = [ExpertArch(widths=(2, 8, 1)), ExpertArch(widths=(2, 16, 1))]
    archs.append(archs[0])
    entries = [
        ExpertEntry.model_validate({
            "id": i, "file": expert_file_name(i, sha), "sha256": sha, "bytes": 100,
            "params": arch.num_parameters(), "arch": arch.to_dict(),
        })
        for i, (arch, sha) in enumerate(zip(archs, ["ab" * 32, "cd" * 32, "ef" * 32], strict=True))
    ]
    assert entries[0].arch is entries[2].arch and entries[0].arch is not entries[1].arch
    assert [entry.expert_arch for entry in entries] == archs
    assert all(entry.arch == arch.to_dict() for entry, arch in zip(entries, archs, strict=True))
    replaced = entries[0].model_copy(update={"arch": archs[1].to_dict()})
    assert replaced.expert_arch == archs[1] and entries[0].expert_arch == archs[0]
