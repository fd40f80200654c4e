from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from experts_store_helpers import make_expert, publish, stand_in_router

from experts_store import (
    ExpertFormatError,
    ManifestError,
    Store,
    StoreError,
    StoreNotFound,
    StoreWriteError,
    StoreWriter,
    save_expert,
)
from experts_store._writer import DEFAULT_RETIRE_AFTER_S

pytestmark = pytest.mark.unit


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_publish_creates_a_readable_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    manifest = publish(root, num_experts=3)
    store = Store.open(root)
    assert store.version == manifest.store_version
    assert store.manifest == manifest
    assert files_under(root) == {
        "manifest.json",
        "report.json",
        ".publish.lock",  # kept: a lock file removed could be locked twice
        manifest.router_file,
        *(e.file for e in manifest.experts),
    }
    # The report names the version it describes (a publish cut short leaves another's).
    assert store.report() == {"seed": 0, "store_version": manifest.store_version}
    x = torch.randn(4, 3)
    assert torch.equal(store.load_expert(1)(x), make_expert((3, 8, 2), seed=1)(x))


def test_nothing_is_published_without_publish(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with StoreWriter(root) as writer:
        writer.add_expert(0, make_expert())
        writer.router_path.write_bytes(b"r")
    assert files_under(root) == set()
    with pytest.raises(StoreNotFound):
        Store.open(root)
    # The folder it made for the store is gone too: a failed first build leaves nothing.
    assert not root.exists()
    root.mkdir()
    with StoreWriter(root):
        pass
    assert root.is_dir()  # one it found stays


def test_exception_before_publish_keeps_previous_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = publish(root, seed=1)
    before = files_under(root)
    with pytest.raises(RuntimeError, match="training crashed"), StoreWriter(root) as writer:
        writer.add_expert(0, make_expert(seed=99))
        raise RuntimeError("training crashed")
    assert files_under(root) == before
    assert Store.open(root).version == first.store_version
    assert Store.open(root).verify() == []


def test_failing_manifest_replace_keeps_previous_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    first = publish(root, seed=1)
    real_replace = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst).name == "manifest.json":
            raise OSError("disk full")
        real_replace(src, dst)

    files_before = sorted(p for p in root.rglob("*") if ".staging-" not in str(p))
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(StoreWriteError) as caught:
        publish(root, seed=2)
    monkeypatch.undo()
    assert str(caught.value) == (
        f"cannot write {root.absolute() / 'manifest.json'}: disk full; nothing was published "
        f"(version {first.store_version} is still live)"
    )
    # The new version's experts and router, moved in before the manifest failed, are gone.
    assert sorted(p for p in root.rglob("*") if ".staging-" not in str(p)) == files_before
    store = Store.open(root)
    assert store.version == first.store_version
    assert store.verify() == []
    assert store.report() == {"seed": 1, "store_version": first.store_version}
    x = torch.randn(3, 3)
    assert torch.equal(store.load_expert(0)(x), make_expert((3, 8, 2), seed=1000)(x))
    assert not list(root.glob(".staging-*"))


def test_republish_gets_new_version_and_keeps_previous_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = publish(root, seed=1)
    old_store = Store.open(root)
    second = publish(root, seed=2)
    assert second.store_version != first.store_version
    assert Store.open(root).version == second.store_version
    # A reader still on the previous manifest keeps working.
    assert old_store.verify() == []
    x = torch.randn(3, 3)
    assert torch.equal(old_store.load_expert(2)(x), make_expert((3, 8, 2), seed=1002)(x))
    clock = Clock()
    third = publish(root, seed=3, now=clock)
    live = {third.router_file, second.router_file}
    live |= {e.file for m in (second, third) for e in m.experts}
    # The first version's files are retired, not deleted: a server may still serve it
    # (it refused the second, or the two came within its watch interval).
    retired = {first.router_file, *(e.file for e in first.experts)} - live
    ledger = json.loads((root / "retired.json").read_text())["retired"]
    assert set(ledger) == retired and set(ledger.values()) == {clock.now.timestamp()}
    assert old_store.verify() == []
    clock.now += timedelta(seconds=DEFAULT_RETIRE_AFTER_S - 1)
    fourth = publish(root, seed=4, now=clock)
    assert retired <= files_under(root)  # not yet: retired 599 s ago
    clock.now += timedelta(seconds=1)
    fifth = publish(root, seed=5, now=clock)
    live = {fourth.router_file, fifth.router_file}
    live |= {e.file for m in (fourth, fifth) for e in m.experts}
    ledger = json.loads((root / "retired.json").read_text())["retired"]
    assert files_under(root) == {"manifest.json", "report.json", "retired.json", ".publish.lock",
                                 *live, *ledger}
    assert not retired & files_under(root)  # deleted 600 s after they were retired
    # Retired by the fourth and fifth publishes (second's and third's), each kept until its
    # own 600 s are up.
    assert set(ledger) == ({second.router_file, third.router_file}
                           | {e.file for m in (second, third) for e in m.experts}) - live


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 11, 30, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def test_an_unreadable_ledger_retires_its_files_anew(tmp_path: Path) -> None:
    root = tmp_path / "store"
    clock = Clock()
    first = publish(root, seed=1, now=clock)
    publish(root, seed=2, now=clock)
    publish(root, seed=3, now=clock)
    (root / "retired.json").write_text("{not json")
    clock.now += timedelta(seconds=DEFAULT_RETIRE_AFTER_S)
    publish(root, seed=4, now=clock)
    # Retired again from now: deleted later, never sooner.
    assert {e.file for e in first.experts} <= files_under(root)


def test_unchanged_experts_keep_their_file(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = publish(root, seed=1)
    second = publish(root, seed=1)
    assert [e.file for e in first.experts] == [e.file for e in second.experts]
    assert Store.open(root).verify() == []


def test_expert_files_written_by_tasks_are_registered(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with StoreWriter(root) as writer:
        for expert_id in range(2):
            written = save_expert(make_expert(seed=expert_id), writer.expert_path(expert_id))
            entry = writer.register_expert_file(expert_id)
            assert entry.sha256 == written.sha256 and entry.bytes == written.bytes
        writer.router_path.write_bytes(b"r")
        manifest = writer.publish(
            task="classification",
            input_dim=3,
            output_dim=2,
            routing="exact",
            branching=4,
            temperature=0.5,
            extra={"dataset": "toy"},
        )
    assert manifest.extra == {"dataset": "toy"}
    assert Store.open(root).manifest.temperature == 0.5
    assert not (root / "report.json").exists()


def test_bad_task_file_is_refused_at_registration(tmp_path: Path) -> None:
    with StoreWriter(tmp_path / "store") as writer:
        writer.expert_path(0).write_bytes(b"not safetensors")
        with pytest.raises(ExpertFormatError) as info:
            writer.register_expert_file(0)
    assert info.value.expert_id == 0


def test_a_task_file_linked_out_of_the_store_is_refused_at_registration(
    tmp_path: Path,
) -> None:
    # It was hashed and recorded through the link, and the store published with it: every
    # server then refused that expert (a link that leads outside the store), 503 for good.
    outside = tmp_path / "elsewhere.safetensors"
    save_expert(make_expert(seed=3), outside)
    with StoreWriter(tmp_path / "store") as writer:
        writer.expert_path(0).symlink_to(outside)
        with pytest.raises(ExpertFormatError, match="leads outside the store") as info:
            writer.register_expert_file(0)
        # A link to another file inside the store is the store's own business: kept.
        inside = writer.staging / "kept.safetensors"
        written = save_expert(make_expert(seed=4), inside)
        writer.expert_path(1).symlink_to(inside)
        assert writer.register_expert_file(1).sha256 == written.sha256
    assert info.value.expert_id == 0
    assert str(outside) not in str(info.value)  # where it leads is not told


def test_missing_ids_or_router_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with StoreWriter(root) as writer:
        writer.add_expert(0, make_expert())
        writer.add_expert(2, make_expert())
        with pytest.raises(StoreError, match="router"):
            writer.publish(
                task="regression", input_dim=3, output_dim=2, routing="tree", branching=2
            )
        writer.router_path.write_bytes(b"r")
        with pytest.raises(ManifestError, match="0..1"):
            writer.publish(
                task="regression", input_dim=3, output_dim=2, routing="tree", branching=2
            )
    assert not (root / "manifest.json").exists()


def test_a_writer_on_a_relative_path_gives_tasks_paths_that_hold_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `momlp build --out ./store`: Ray tasks write experts to `expert_path` from their own
    # working folder.
    monkeypatch.chdir(tmp_path)
    with StoreWriter("store") as writer:
        target = writer.expert_path(0)
        monkeypatch.chdir(tmp_path.parent)
        assert target.is_absolute()
        save_expert(make_expert((3, 8, 2), seed=0), target)
        writer.add_expert(1, make_expert((3, 8, 2), seed=1))
    assert target.is_relative_to(tmp_path / "store")


def test_a_diverged_runs_nan_is_written_as_null_so_report_json_stays_json(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    with StoreWriter(root) as writer:
        writer.add_expert(0, make_expert((3, 8, 2), seed=0))
        writer.router_path.write_bytes(stand_in_router(1, 3, 0))
        writer.write_report({"mixture": {"value": float("nan")},
                             "losses": [1.0, float("inf"), (2.0, float("-inf"))]})
        writer.publish(task="regression", input_dim=3, output_dim=2, routing="tree",
                       branching=2)
    text = (root / "report.json").read_text()
    report = json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} in {text}"))
    assert report["mixture"] == {"value": None}
    assert report["losses"] == [1.0, None, [2.0, None]]
