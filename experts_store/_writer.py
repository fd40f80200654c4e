"""StoreWriter: stage a store's files, then publish them atomically.

Publishing moves the staged files to content-addressed names (never overwriting a file
the live manifest references), then replaces manifest.json with one ``os.replace``: a
crash at any point leaves either the previous store or the new one readable. Writers into
one store may run at once (`experts_store._locks`): each publish holds the store's lock, and
no publish removes the staging folder of a writer still at work.

The switch itself is `experts_store._switch`; the staging folder's name and locks, and how an
abandoned one is told, `experts_store._staging`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from pydantic import ValidationError

from experts_store._checksum import fast_checksum, new_fast_digest
from experts_store._exceptions import ManifestError, StoreChanged, StoreError, StoreWriteError
from experts_store._format import (
    ExpertFile,
    parse_header,
    read_expert_bytes,
    save_expert,
    sha256_hex,
)
from experts_store._graph import GraphBlock
from experts_store._hyper import HyperSpec
from experts_store._live import MANIFEST_NAME, live_manifest, live_version
from experts_store._locks import FileLock
from experts_store._manifest import (
    MANIFEST_FORMAT_VERSION,
    ExpertEntry,
    GateSpec,
    Manifest,
    expert_file_name,
    router_file_name,
)
from experts_store._model import ExpertMLP
from experts_store._pmoe import PMoESpec
from experts_store._report import REPORT_NAME, finite, report_text
from experts_store._retired import DEFAULT_RETIRE_AFTER_S, retire_unreferenced
from experts_store._staging import (
    STAGING_PREFIX,
    WRITER_LOCK_NAME,
    abandoned,
    new_version,
    publish_lock,
)
from experts_store._switch import fsync_dir, switch_in

# The file names and the default are offered here too: `_store` and the tests take them from
# this module.
__all__ = ["DEFAULT_RETIRE_AFTER_S", "MANIFEST_NAME", "REPORT_NAME", "StoreWriter"]

logger = logging.getLogger(__name__)


class StoreWriter:
    """Stage experts, router and report under ``root``, then :meth:`publish` them.

    Use as a context manager: leaving it without publishing (or with an exception)
    removes the staging directory and leaves the previous store untouched. Writers may run
    at the same time: the last to publish is live, and one that finds a version published
    since it began says so (a warning). With `based_on` (the version it derives from, as
    `momlp store calibrate` does) it refuses instead: `StoreChanged`, nothing published.

    A publish keeps every file the new and the previous manifest reference; a file neither
    references is retired (`retired.json` records when) and deleted by the first publish
    `retire_after_s` after that, so a server serving an older version keeps its files.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        now: Callable[[], datetime] | None = None,
        stale_staging_seconds: float = 3600.0,
        retire_after_s: float = DEFAULT_RETIRE_AFTER_S,
        based_on: str | None = None,
    ) -> None:
        # Absolute: `expert_path` is handed to Ray tasks, which write there from their own
        # working directory (another one on another node).
        self.root = Path(root).absolute()
        self._now = now or (lambda: datetime.now(UTC))
        self._stale_staging_seconds = stale_staging_seconds
        self._retire_after_s = retire_after_s
        self._based_on = based_on
        # A store folder this writer made is removed again if nothing is published in it: a
        # failed first build leaves no empty folder behind.
        self._made_root = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        self._started_on = live_version(self.root)
        # Named anew at publish, so that versions sort in the order they went live.
        self.version = new_version(self._now())
        self.staging = self.root / f"{STAGING_PREFIX}{self.version}"
        try:
            (self.staging / "experts").mkdir(parents=True)
            # Held until publish or abort: no other writer's publish takes this folder for
            # the leftovers of a dead one, however long training runs.
            lock = FileLock.take(self.staging / WRITER_LOCK_NAME, wait_s=1.0)
        except OSError as exc:  # out of inodes, a read-only file system, permissions
            # Unlocked, the folder would wait an hour for another writer to collect it.
            self._remove_staging()
            raise StoreWriteError.of(exc, self.staging, self._started_on) from exc
        if lock is None:
            self._remove_staging()
            raise StoreError(f"cannot lock the staging folder {self.staging}")
        self._lock = lock
        self._report: dict[str, Any] | None = None
        self.router_path = self.staging / "router.safetensors"
        self._entries: dict[int, ExpertEntry] = {}
        # Kind files (a hyper store's f and conditions): staged path -> store-relative name.
        self._kind_files: dict[str, Path] = {}
        self._routers: set[str] = set()  # kind routers staged by stage_router (names)
        self._closed = False

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()

    def abort(self) -> None:
        """Drop everything staged (no-op after publish)."""
        self._closed = True
        self._remove_staging()
        self._lock.release()

    def _remove_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._made_root:
            with contextlib.suppress(OSError):  # not empty: something was published there
                self.root.rmdir()

    def expert_path(self, expert_id: int) -> Path:
        """Where a (Ray) task may write expert ``expert_id`` with ``save_expert``."""
        return self.staging / "experts" / f"{self._check_id(expert_id)}.safetensors"

    def add_expert(self, expert_id: int, expert: ExpertMLP) -> ExpertEntry:
        self._check_open()
        written = save_expert(expert, self.expert_path(expert_id))
        return self._record(expert_id, written)

    def register_expert_file(self, expert_id: int) -> ExpertEntry:
        """Record a file a task wrote at ``expert_path(expert_id)`` (its header is checked; a
        file that a symbolic link leads out of the store is refused unread, as a server would
        refuse it once published)."""
        self._check_open()
        sha256, fast = hashlib.sha256(), new_fast_digest()
        buf = read_expert_bytes(
            self.expert_path(expert_id), expert_id=expert_id, digests=(sha256, fast),
            store_root=str(self.root),
        )
        header = parse_header(buf, expert_id=expert_id)
        written = ExpertFile(
            sha256=sha256.hexdigest(),
            bytes=buf.numel(),
            params=header.arch.num_parameters(),
            arch=header.arch,
            checksum=fast_checksum(fast),
        )
        return self._record(expert_id, written)

    def link_expert_file(self, expert_id: int, source: Path | str) -> ExpertEntry:
        """Stage an existing expert file (e.g. the previous version's) unchanged and record it.

        A hard link where the file system allows it, else a copy: a republish that keeps an
        expert keeps its bytes, hence its sha256, so servers keep it warm across the swap.
        """
        self._check_open()
        target = self.expert_path(expert_id)
        target.unlink(missing_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
        return self.register_expert_file(expert_id)

    def kind_file(self, name: str, staged: Path) -> str:
        """Record a kind's file written at `staged` (inside `self.staging`) to publish as
        `name` (content-named by the caller, e.g. `hyper-<sha16>.safetensors`)."""
        self._check_open()
        if "/" in name or name.startswith(".") or staged.parent != self.staging:
            raise ValueError(f"kind file {name!r} must be a plain name staged in {self.staging}")
        self._kind_files[name] = staged
        return name

    def stage_router(self, source: Path | str) -> str:
        """Move a router file a kind needs beside the store's (a graph node's prototype
        tree) into staging under its content name, and return that store-relative name."""
        self._check_open()
        name = router_file_name(sha256_hex(Path(source).read_bytes()))
        os.replace(source, self.staging / name)
        self._routers.add(name)
        return name

    def write_report(self, report: Mapping[str, Any]) -> None:
        """Keep report.json for the publish, which writes it (naming the version it
        describes, `store_version`) right after the manifest."""
        self._check_open()
        # A diverged run's NaN or infinity is written as null: JSON has neither, and other
        # readers (browsers, jq, most JSON libraries) refuse Python's NaN token.
        checked: dict[str, Any] = finite(dict(report))
        report_text(checked)  # refused here, not at publish, if it cannot be written
        self._report = checked

    def publish(
        self,
        *,
        task: Literal["regression", "classification"],
        input_dim: int,
        output_dim: int,
        routing: Literal["tree", "exact"],
        branching: int,
        temperature: float = 1.0,
        extra: Mapping[str, Any] | None = None,
        kind: str = "momlp",
        gate: GateSpec | None = None,
        hyper: HyperSpec | None = None,
        pmoe: PMoESpec | None = None,
        graph: GraphBlock | None = None,
    ) -> Manifest:
        """Make the staged store the live one and return its manifest.

        `gate`, when given, is the store's default gate and sets the temperature (manifest
        format 2); without it the gate block records `temperature` as given by the caller.
        Waits for another publish into the same store to finish first. A live manifest that
        `Store.open` refuses (invalid, past MAX_MANIFEST_BYTES, not a regular file, a link
        out of the store) is replaced and no file is retired; a warning names the store and
        why.
        """
        self._check_open()
        with publish_lock(self.root):
            live, previous = live_manifest(self.root)
            if self._based_on is not None and live != self._based_on:
                raise StoreChanged(root=self.root, based_on=self._based_on, live=live)
            if live is not None and live != self._started_on:
                logger.warning(
                    "version %s went live in %s while this writer was at work; this publish "
                    "replaces it", live, self.root,
                )
            self.version = new_version(self._now())
            router_file: str | None
            if self.router_path.is_file():
                router_file = router_file_name(sha256_hex(self.router_path.read_bytes()))
            elif graph is not None:
                # A graph routes with its nodes' routers; the top-level name (format-1 readers
                # need one) is its first node's.
                router_file = graph.nodes[0].router_file
            elif kind == "momlp":
                raise StoreError(f"nothing staged at {self.router_path}: save the router first")
            else:
                router_file = None  # a kind without a router (a request-conditioned hyper store)
            entries = [self._entries[i] for i in sorted(self._entries)]
            try:
                manifest = Manifest(
                    format_version=MANIFEST_FORMAT_VERSION,
                    store_version=self.version,
                    created_at=self._now().isoformat(),
                    task=task,
                    input_dim=input_dim,
                    output_dim=output_dim,
                    routing=routing,
                    branching=branching,
                    num_experts=len(entries),
                    temperature=gate.temperature if gate is not None else temperature,
                    router_file=router_file,
                    experts=entries,
                    extra=dict(extra or {}),
                    kind=kind,
                    gate=gate if gate is not None else GateSpec(temperature=temperature),
                    hyper=hyper,
                    pmoe=pmoe,
                    graph=graph,
                )
            except ValidationError as exc:
                raise ManifestError(root=self.root, message=str(exc)) from exc
            unstaged = sorted(manifest.referenced_files - self._routers - set(self._kind_files)
                              - {manifest.router_file} - {e.file for e in entries})
            if unstaged:
                raise StoreError(f"nothing staged for {unstaged}: stage_router() them first")

            self._go_live(manifest, entries, live, previous)
            return manifest

    def _go_live(
        self,
        manifest: Manifest,
        entries: list[ExpertEntry],
        live: str | None,
        previous: set[str] | None,
    ) -> None:
        """Move the staged files in and replace the manifest (`switch_in`), then tidy up."""
        moves = [(self.expert_path(entry.id), self.root / entry.file) for entry in entries]
        if self.router_path.is_file():
            moves.append((self.router_path, self.root / str(manifest.router_file)))
        moves += [(staged, self.root / name) for name, staged in self._kind_files.items()]
        moves += [(self.staging / name, self.root / name) for name in sorted(self._routers)]
        report = None
        if self._report is not None:
            # Naming the version it describes.
            report = report_text({**self._report, "store_version": self.version}) + "\n"
        staged_report = switch_in(
            self.root,
            self.staging,
            manifest=manifest.model_dump_json(indent=2) + "\n",
            report=report,
            moves=moves,
            live=live,
        )
        try:
            # Live from here: a failure is the tidying's, not the publish's.
            fsync_dir(self.root)
            if staged_report is not None:
                os.replace(staged_report, self.root / REPORT_NAME)
            else:
                # A report left from the previous publish would describe other experts.
                (self.root / REPORT_NAME).unlink(missing_ok=True)
            logger.info(
                "published store %s version %s (%s experts)",
                self.root,
                manifest.store_version,
                manifest.num_experts,
            )
            self._collect_garbage(manifest, previous)
        except OSError as exc:
            logger.warning(
                "store %s version %s is live, but tidying up after it failed: %s",
                self.root, manifest.store_version, exc,
            )
        self.abort()

    def _collect_garbage(self, manifest: Manifest, previous: set[str] | None) -> None:
        """Retire files neither the new nor the previous manifest references, and delete
        those retired at least `retire_after_s` ago (a server may still serve an older
        version than the previous one: deleting its files at once answered 503s)."""
        now = self._now().timestamp()
        if previous is not None:  # None: which files the replaced manifest needs is unknown
            keep = previous | manifest.referenced_files
            retire_unreferenced(self.root, keep, now, self._retire_after_s)
        for staging in self.root.glob(f"{STAGING_PREFIX}*"):
            if (
                staging != self.staging
                and staging.is_dir()
                and abandoned(staging, now, self._stale_staging_seconds)
            ):
                logger.info("removing %s, left by a writer no longer running", staging)
                shutil.rmtree(staging, ignore_errors=True)

    def _record(self, expert_id: int, written: ExpertFile) -> ExpertEntry:
        entry = ExpertEntry(
            id=expert_id,
            file=expert_file_name(expert_id, written.sha256),
            sha256=written.sha256,
            bytes=written.bytes,
            params=written.params,
            arch=written.arch.to_dict(),
            checksum=written.checksum,
        )
        self._entries[expert_id] = entry
        return entry

    def _check_id(self, expert_id: int) -> int:
        if isinstance(expert_id, bool) or int(expert_id) != expert_id or expert_id < 0:
            raise ValueError(f"expert ids are non-negative ints, got {expert_id!r}")
        return int(expert_id)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("this StoreWriter was already published or aborted")
