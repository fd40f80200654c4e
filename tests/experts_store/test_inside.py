"""A store's files are read only where they lie inside it once links are followed: a
manifest.json, router, kind's file or expert file that a symbolic link leads out of the store
is refused naming it (at open; an expert's at load, by a Store and by an actor's loader),
while links inside the store, and a store directory that is itself a link, are followed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from experts_store_helpers import publish

import trainer.hyper as hyper
from experts_store import (
    ExpertFormatError,
    ExpertLoadError,
    ExpertRefLoader,
    FrozenHyperNetwork,
    ManifestError,
    Store,
)

pytestmark = pytest.mark.unit


def move_out(path: Path, elsewhere: Path) -> Path:
    """Move the file out of the store and leave a link to it in its place; the bytes are the
    same, so every checksum still holds."""
    elsewhere.mkdir(parents=True, exist_ok=True)
    target = elsewhere / path.name
    shutil.move(path, target)
    path.symlink_to(target)
    return target


def test_a_manifest_that_links_out_of_the_store_is_refused(
    store_root: Path, tmp_path: Path
) -> None:
    target = move_out(store_root / "manifest.json", tmp_path / "elsewhere")
    with pytest.raises(ManifestError) as info:
        Store.open(store_root)
    assert str(info.value) == (
        f"bad manifest in {store_root}: manifest.json is a link that leads outside the store"
    )
    assert str(target) not in str(info.value)  # a reload's 503 shows it to the caller


def test_a_router_that_links_out_of_the_store_is_refused_at_open(
    store_root: Path, tmp_path: Path
) -> None:
    name = Store.open(store_root).manifest.router_file
    assert name is not None
    move_out(store_root / name, tmp_path / "elsewhere")
    with pytest.raises(ManifestError, match=f"{name} is a link that leads outside the store$"):
        Store.open(store_root)


def test_a_kinds_file_that_links_out_of_the_store_is_refused_at_open(tmp_path: Path) -> None:
    root = tmp_path / "store"
    torch.manual_seed(0)
    f = hyper.HyperNetwork(3, hyper.PrimarySpec(4, (6, 5), 2), depth=1, width=16)
    manifest = hyper.publish_hypernetwork(root, f)
    assert manifest.hyper is not None
    name = manifest.hyper.hypernetwork.file
    move_out(root / name, tmp_path / "elsewhere")
    with pytest.raises(ManifestError, match=f"{name} is a link that leads outside the store$"):
        Store.open(root)


def test_f_linked_out_after_the_open_is_refused_where_an_actor_loads_it(tmp_path: Path) -> None:
    # An actor reads f long after the store's open checked it.
    root = tmp_path / "store"
    torch.manual_seed(0)
    f = hyper.HyperNetwork(3, hyper.PrimarySpec(4, (6, 5), 2), depth=1, width=16)
    manifest = hyper.publish_hypernetwork(root, f)
    assert manifest.hyper is not None
    spec = manifest.hyper.hypernetwork
    Store.open(root)
    hyper_file = root / spec.file
    FrozenHyperNetwork.load(hyper_file, expected_sha256=spec.sha256)
    move_out(hyper_file, tmp_path / "elsewhere")
    with pytest.raises(ExpertFormatError, match="is a link that leads outside the store$"):
        FrozenHyperNetwork.load(hyper_file, expected_sha256=spec.sha256)


def test_an_expert_that_links_out_of_the_store_is_refused_at_every_load(
    store_root: Path, tmp_path: Path
) -> None:
    store = Store.open(store_root)
    path = store.expert_path(1)
    target = move_out(path, tmp_path / "elsewhere")
    says = f"expert 1: bad expert file: {path} is a link that leads outside the store$"
    with pytest.raises(ExpertFormatError, match=says) as info:
        store.load_frozen(1)
    assert info.value.expert_id == 1
    assert str(target) not in str(info.value)  # a 503's reason: not where the link leads
    with pytest.raises(ExpertFormatError, match=says):
        store.load_expert(1)
    # A serving actor's loader: the 503 names the expert and its file.
    with pytest.raises(ExpertFormatError, match=says):
        ExpertRefLoader("cpu").load(store.expert_ref(1))
    problems = store.verify()
    assert [(p.expert_id, p.message) for p in problems] == [(1, str(info.value))]
    store.load_frozen(0)  # the others still load


def test_an_experts_folder_that_links_out_of_the_store_is_refused(
    store_root: Path, tmp_path: Path
) -> None:
    store = Store.open(store_root)
    move_out(store_root / "experts", tmp_path / "elsewhere")
    with pytest.raises(ExpertFormatError, match="outside the store"):
        ExpertRefLoader("cpu").load(store.expert_ref(0))


def test_links_inside_the_store_and_a_linked_store_folder_are_followed(
    tmp_path: Path,
) -> None:
    real = tmp_path / "volume" / "store-v2"
    publish(real)
    # Files the store links to one another (a shared folder inside it), and the manifest.
    shared = real / "shared"
    move_out(real / "experts" / os.listdir(real / "experts")[0], shared)
    move_out(real / "manifest.json", shared)
    os.symlink(os.path.relpath(shared / "manifest.json", real), real / "relative.json")
    (real / "manifest.json").unlink()
    (real / "manifest.json").symlink_to("relative.json")
    # The store's folder is a link (`/srv/store -> /mnt/volume/store-v2`).
    linked = tmp_path / "srv" / "store"
    linked.parent.mkdir()
    linked.symlink_to(real)
    for root in (real, linked):
        store = Store.open(root)
        assert store.verify() == []
        loader = ExpertRefLoader("cpu")
        for expert_id in range(3):
            store.load_frozen(expert_id)
            loader.load(store.expert_ref(expert_id))


def test_a_linked_store_folder_moved_to_another_store_judges_files_by_where_it_leads_now(
    tmp_path: Path,
) -> None:
    # Its real path is remembered between loads, and trusted only while it still leads
    # there: a file of the store it now leads to loads, and one that leads back into the
    # store it led to before is refused, also as the first load after the move.
    first, second = tmp_path / "volume" / "v1", tmp_path / "volume" / "v2"
    publish(first)
    shutil.copytree(first, second)
    linked = tmp_path / "srv" / "store"
    linked.parent.mkdir()
    linked.symlink_to(first)
    store = Store.open(linked)
    loader = ExpertRefLoader("cpu")
    loader.load(store.expert_ref(0))
    path = second / "experts" / os.path.basename(store.expert_ref(2).path)
    path.unlink()
    path.symlink_to(first / "experts" / path.name)
    linked.unlink()
    linked.symlink_to(second)
    with pytest.raises(ExpertFormatError, match="outside the store"):
        ExpertRefLoader("cpu").load(store.expert_ref(2))
    ExpertRefLoader("cpu").load(store.expert_ref(1))
    with pytest.raises(ExpertFormatError, match="outside the store"):
        ExpertRefLoader("cpu").load(store.expert_ref(2))


def test_without_proc_the_links_of_the_path_are_followed(
    store_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store.open(store_root)
    move_out(store.expert_path(2), tmp_path / "elsewhere")
    readlink = os.readlink

    def no_proc(path: str | os.PathLike[str], *args: object, **kwargs: object) -> str:
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return readlink(path)

    monkeypatch.setattr(os, "readlink", no_proc)
    with pytest.raises(ExpertFormatError, match="expert 2: .* outside the store"):
        store.load_frozen(2)
    store.load_frozen(0)


def test_a_hard_linked_expert_is_its_file(store_root: Path, tmp_path: Path) -> None:
    # What `StoreWriter.link_expert_file` makes: no link to follow, wherever else it lies.
    store = Store.open(store_root)
    path = store.expert_path(0)
    outside = tmp_path / "elsewhere.safetensors"
    os.link(path, outside)
    store.load_frozen(0)
    ExpertRefLoader("cpu").load(store.expert_ref(0))


def test_an_actors_loader_judges_a_link_on_a_contents_first_load_and_checksums_after(
    store_root: Path, tmp_path: Path
) -> None:
    # Judged on every load, the check cost ~7 % of an actor's CPU; after the first load the
    # bytes must match the same checksum, so a link swapped in reads nothing else.
    store = Store.open(store_root)
    loader = ExpertRefLoader("cpu")
    loader.load(store.expert_ref(1))
    path = store.expert_path(1)
    other = tmp_path / "elsewhere" / "other.safetensors"
    other.parent.mkdir()
    shutil.copyfile(store.expert_path(0), other)  # another expert's bytes
    path.unlink()
    path.symlink_to(other)
    with pytest.raises(ExpertLoadError, match="expert 1"):
        loader.load(store.expert_ref(1))
    with pytest.raises(ExpertFormatError, match="outside the store"):
        ExpertRefLoader("cpu").load(store.expert_ref(1))  # a first load: judged


def test_a_ref_without_a_fast_checksum_is_judged_on_every_load(
    store_root: Path, tmp_path: Path
) -> None:
    # A pre-checksum store's expert is read unchecked after its first load: skipping the link
    # check there too served another file through a link out of the store (a review of
    # 024488e).
    import dataclasses

    store = Store.open(store_root)
    ref = dataclasses.replace(store.expert_ref(1), checksum=None)
    loader = ExpertRefLoader("cpu")
    loader.load(ref)
    other = tmp_path / "elsewhere" / "other.safetensors"
    other.parent.mkdir()
    shutil.copyfile(store.expert_path(0), other)
    path = store.expert_path(1)
    path.unlink()
    path.symlink_to(other)
    with pytest.raises(ExpertFormatError, match="outside the store"):
        loader.load(ref)
