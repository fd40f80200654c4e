"""Writers into one store at the same time: builds, calibrations and API publishes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from experts_store_helpers import make_expert, publish, publish_with

from experts_store import Store, StoreChanged, StoreWriteError, StoreWriter

pytestmark = pytest.mark.unit


def test_a_writer_at_work_keeps_its_staging_folder_however_old(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A build training for over an hour had its staging folder removed by another publish
    # (the folder's time does not change while experts are written below it), and failed.
    root = tmp_path / "store"
    publish(root, seed=1)
    long_build = StoreWriter(root)
    long_build.add_expert(0, make_expert(seed=7))
    for path in (long_build.staging, long_build.staging / "experts"):
        os.utime(path, (0, 0))
    other = publish(root, seed=2)
    assert long_build.staging.is_dir()
    with caplog.at_level(logging.WARNING, logger="experts_store._writer"):
        mine = publish_with(long_build, seed=3)
    assert Store.open(root).version == mine.store_version
    # It took the place of a version published while it worked, and says so.
    assert f"version {other.store_version} went live in {root} while this writer" in caplog.text
    assert not list(root.glob(".staging-*"))


_DIES_WITHOUT_CLEANING_UP = """
import os, sys
from experts_store import StoreWriter
writer = StoreWriter(sys.argv[1])
print(writer.staging, flush=True)
os._exit(0)  # as SIGKILL: no abort, no cleanup; the kernel drops its lock
"""


def test_the_staging_folder_of_a_writer_that_died_goes_at_the_next_publish(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    died = subprocess.run(
        [sys.executable, "-c", _DIES_WITHOUT_CLEANING_UP, str(root)],
        capture_output=True, text=True, check=True,
    )
    staging = Path(died.stdout.strip())
    assert staging.is_dir()
    publish(root, seed=1)
    assert staging.is_dir()  # its lock was free for under 10 s: maybe a writer starting
    os.utime(staging / ".writer.lock", (0, 0))
    with caplog.at_level(logging.INFO, logger="experts_store._writer"):
        publish(root, seed=2)
    assert not staging.exists()
    assert f"removing {staging}, left by a writer no longer running" in caplog.text


def test_a_staging_folder_without_a_lock_goes_only_once_stale(tmp_path: Path) -> None:
    # Left by a writer from before the locks: its age is all there is to go by.
    root = tmp_path / "store"
    old, young = root / ".staging-old", root / ".staging-young"
    for folder in (old, young):
        (folder / "experts").mkdir(parents=True)
    os.utime(old, (0, 0))
    publish(root)
    assert not old.exists() and young.is_dir()


def test_a_writer_based_on_a_version_refuses_to_publish_over_another(tmp_path: Path) -> None:
    # `momlp store calibrate` relinks the experts of the version it read: published over a
    # build that went live meanwhile, it silently brought the old experts back.
    root = tmp_path / "store"
    first = publish(root, seed=1)
    calibrating = StoreWriter(root, based_on=first.store_version)
    build = publish(root, seed=2)
    with pytest.raises(StoreChanged) as caught, calibrating:
        publish_with(calibrating, seed=3)
    assert (caught.value.based_on, caught.value.live) == (first.store_version, build.store_version)
    assert "nothing was published" in str(caught.value)
    store = Store.open(root)
    assert store.version == build.store_version
    assert store.report() == {"seed": 2, "store_version": build.store_version}
    x = torch.randn(2, 3)
    assert torch.equal(store.load_expert(0)(x), make_expert((3, 8, 2), seed=2000)(x))
    assert not calibrating.staging.exists()


def test_versions_sort_in_the_order_they_went_live(tmp_path: Path) -> None:
    # Named when the writer began, a build that started first and published last had the
    # smaller version: logs and metrics read it as the older one.
    root = tmp_path / "store"
    slow, quick = StoreWriter(root), StoreWriter(root)
    first_live = publish_with(quick, seed=1)
    last_live = publish_with(slow, seed=2)
    assert first_live.store_version < last_live.store_version
    assert Store.open(root).version == last_live.store_version


def test_publishes_at_the_same_time_leave_a_store_whose_report_is_its_own(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    errors: list[BaseException] = []

    def publisher(seed: int) -> None:
        try:
            for round_ in range(4):
                publish(root, seed=seed * 10 + round_)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=publisher, args=(seed,)) for seed in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    store = Store.open(root)
    assert store.verify() == []
    report = store.report()
    assert report is not None and report["store_version"] == store.version
    assert not list(root.glob(".staging-*")) and not list(root.glob(".retired.json.tmp-*"))


def test_a_report_left_by_another_version_is_not_taken_for_this_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A publish killed between the manifest and the report leaves the previous report.
    root = tmp_path / "store"
    manifest = publish(root, seed=1)
    (root / "report.json").write_text(json.dumps({"seed": 0, "store_version": "older"}))
    assert Store.open(root).report() is None
    assert f"describes version older, not {manifest.store_version}: ignored" in caplog.text
    (root / "report.json").write_text(json.dumps({"seed": 0}))  # written before versions
    assert Store.open(root).report() == {"seed": 0}


def test_a_publish_waits_for_the_store_lock(tmp_path: Path) -> None:
    from experts_store._locks import FileLock

    root = tmp_path / "store"
    first = publish(root, seed=1)
    held = FileLock.take(root / ".publish.lock")
    assert held is not None
    writer = StoreWriter(root)
    published: list[str] = []
    waiting = threading.Thread(target=lambda: published.append(
        publish_with(writer, seed=2).store_version))
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive() and Store.open(root).version == first.store_version
    held.release()
    waiting.join(timeout=30)
    assert published == [Store.open(root).version]



def test_a_publish_whose_tidying_fails_is_live_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The version went live, then the garbage collection raised: the command exited 1 and
    # an operator took the live version for not published.
    root = tmp_path / "store"
    publish(root, seed=1)

    def fails(*args: object) -> None:
        raise PermissionError(13, "Permission denied", str(root / ".staging-x/.writer.lock"))

    monkeypatch.setattr(StoreWriter, "_collect_garbage", fails)
    with caplog.at_level(logging.WARNING, logger="experts_store._writer"):
        second = publish(root, seed=2)
    assert Store.open(root).version == second.store_version
    assert f"version {second.store_version} is live, but tidying up after it failed" in caplog.text
    assert not list(root.glob(".staging-*"))


def test_a_writer_that_cannot_set_up_leaves_no_staging_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Out of inodes, the lock file could not be made: the unlocked folder stayed an hour.
    import experts_store._writer as writer_module

    root = tmp_path / "store"
    first = publish(root, seed=1)

    def no_inodes(path: Path, **options: object) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(writer_module.FileLock, "take", no_inodes)
    with pytest.raises(StoreWriteError, match="No space left on device") as caught:
        StoreWriter(root)
    assert f"(version {first.store_version} is still live)" in str(caught.value)
    assert not list(root.glob(".staging-*"))


def test_the_lock_files_are_made_as_the_umask_allows_like_every_other_store_file(
    tmp_path: Path,
) -> None:
    # They were made 0644 whatever the umask: in a store a group shares (setgid folder,
    # umask 002) the second member's publish failed with "Permission denied:
    # .publish.lock", after the whole of its training. `flock` needs no write access, so
    # they are opened read-only too.
    root = tmp_path / "store"
    previous = os.umask(0o002)
    try:
        writer = StoreWriter(root)
        writer_lock = (writer.staging / ".writer.lock").stat().st_mode & 0o777
        publish_with(writer, seed=1)
        writer.abort()
    finally:
        os.umask(previous)
    assert writer_lock == 0o664
    assert (root / ".publish.lock").stat().st_mode & 0o777 == 0o664
    assert (root / "manifest.json").stat().st_mode & 0o777 == 0o664
