"""One published store version as the server holds it: data, never actors.

A `StoreVersion` is the store, its served model (the kind's planner/combiner over its router
and each expert's `ExpertRef`) and the batcher that serves that model. Requests enter one
version and keep it until they have answered, so a request is served entirely by one version
(its router and its experts) even while a newer one goes live; the pool underneath is shared
by all of them.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import stat
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from experts_store import (
    MAX_MANIFEST_BYTES,
    Clock,
    ExpertRef,
    Manifest,
    Pace,
    Store,
    decode_json,
    decode_json_member,
)
from server._settings import Settings
from server.batching import BatchAnswer, Batcher, OpenConnections, RouteRunner
from server.kinds import ServedModel
from server.pool import ExpertPool

__all__ = [
    "BatcherFactory",
    "BatcherLike",
    "StoreVersion",
    "StoreVersionReader",
    "default_batcher",
    "read_store_version",
]


# Rows freed between two calls of a release's pace: ~0.5 ms of deallocation at K=100,000.
_RELEASE_SLICE = 512
# The start of manifest.json the watcher reads first: a writer puts `store_version` second,
# a few dozen bytes in, and a K=100,000 manifest's whole 43 MB took ~1 s to decode at a pace.
_HEAD_BYTES = 1 << 16


class BatcherLike(Protocol):
    """What the server needs of `server.batching.Batcher`."""

    async def submit(
        self, x: torch.Tensor | np.ndarray, options: Hashable | None = None
    ) -> BatchAnswer: ...
    async def close(self) -> None: ...
    @property
    def queued_rows(self) -> int:
        """Rows waiting to be batched or computed (the metrics' `momlp_queue_rows`)."""
        ...


BatcherFactory = Callable[[ServedModel, ExpertPool, Settings, Clock], BatcherLike]


def default_batcher(
    model: ServedModel,
    pool: ExpertPool,
    settings: Settings,
    clock: Clock,
    *,
    open_connections: OpenConnections | None = None,
    queued_elsewhere: Callable[[Batcher], int] | None = None,
) -> BatcherLike:
    return Batcher(
        model,
        pool,
        settings,
        clock,
        max_inflight_batches=settings.max_inflight_batches,
        open_connections=open_connections,
        queued_elsewhere=queued_elsewhere,
    )


@dataclass
class StoreVersion:
    store: Store
    model: ServedModel
    batcher: BatcherLike
    # Routes /v1/route's requests, which no batch carries: on the event loop when cheap.
    route_runner: RouteRunner
    in_flight: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def manifest(self) -> Manifest:
        return self.store.manifest

    @property
    def version(self) -> str:
        return self.manifest.store_version

    @property
    def experts(self) -> list[ExpertRef]:
        """This version's experts, indexed by expert id."""
        return self.model.experts

    # Once per version, for GET /v1/experts: at K=100,000 the map took 83 ms and the rows
    # ~300 ms of the event loop on every call (benchmarks/RESULTS.md, fifty-second session).
    # Read only.
    @cached_property
    def expert_ids(self) -> dict[str, list[int]]:
        """Content hash -> this version's expert ids with that content."""
        ids: dict[str, list[int]] = {}
        for ref in self.experts:
            ids.setdefault(ref.sha256, []).append(ref.expert_id)
        return ids

    @cached_property
    def expert_rows(self) -> list[tuple[int, int, int, str]]:
        """(id, bytes, params, sha256) of each expert, in id order."""
        return [(e.id, e.bytes, e.params, e.sha256) for e in self.manifest.experts]

    async def close(self) -> None:
        await self.batcher.close()

    def release(self, pace: Pace) -> None:
        """Free this version's per-expert objects a slice at a time, calling `pace` after each
        slice. Only for a closed version no request can still use: its rows are emptied."""
        rows: list[object] = [self.__dict__.pop("expert_rows", None)]
        rows += [self.__dict__.pop("expert_ids", None), self.model.experts, self.manifest.experts]
        rows.append(self.store.refs)  # the same refs as the model's, kept by the store
        for held in rows:
            if isinstance(held, dict):
                while held:
                    for key in list(itertools.islice(held, _RELEASE_SLICE)):
                        del held[key]
                    pace()
            elif isinstance(held, list):
                while held:
                    del held[-_RELEASE_SLICE:]
                    pace()


def read_store_version(root: Path) -> str | None:
    """The published store_version, read without opening the whole store (None if absent)."""
    return StoreVersionReader(root).store_version()


class StoreVersionReader:
    """`read_store_version` for the store watcher: the manifest is parsed again only when its
    file changed.

    The watcher asks every `watch_interval_s`. A K=100,000 store's manifest.json is 43 MB, and
    parsing it took ~0.7 s holding the GIL: the event loop stood still for that long every
    2 s (benchmarks/RESULTS.md, fifty-second session). A publish renames a new file over the
    manifest, and an edit in place changes its size or times, so an unchanged (device, inode,
    size, mtime, ctime) of the opened file means an unchanged version. Of a changed file it
    reads the start, and the rest only when the version is not there.
    """

    def __init__(self, root: Path) -> None:
        self._path = root / "manifest.json"
        self._lock = threading.Lock()  # the watcher's and a reload's reads may overlap
        self._seen: tuple[tuple[int, ...], str | None] | None = None

    def store_version(self, pace: Pace | None = None) -> str | None:
        """As `read_store_version`, from the last parse while the file is the same. `pace`:
        see `experts_store.decode_json` (a changed K=100,000 manifest is 0.6 s of parsing)."""
        try:
            # Not blocking: a FIFO put at the path would hold the watcher's thread for good.
            with open(os.open(self._path, os.O_RDONLY | os.O_NONBLOCK), "rb") as fh:
                # The stamp of the file read, not of whatever the path names a moment later.
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                    return None  # no version: the swap's open refuses it, naming why
                stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                with self._lock:
                    seen = self._seen
                    if seen is not None and seen[0] == stamp:
                        return seen[1]
                head = fh.read(_HEAD_BYTES)
                version = _version_in_head(head) if len(head) == _HEAD_BYTES else None
                if version is None:
                    version = _store_version_of(head + fh.read(), pace)
                elif seen is not None and version == seen[1] and st.st_size != seen[0][2]:
                    # The served version in a file of another size: cut short or edited in
                    # place (a publish names a new version). Only the whole file says whether
                    # it still parses; one that does not is refused like an emptied one.
                    version = _whole_manifest_version(head + fh.read(), pace)
        except OSError:
            return None
        with self._lock:
            self._seen = (stamp, version)
        return version


def _version_in_head(head: bytes) -> str | None:
    """The version in the start of a longer manifest; None when the start does not settle
    it (the whole file decides: absent, not JSON, or cut short inside the member)."""
    try:
        version = decode_json_member(head, "store_version")
    except (ValueError, KeyError):
        return None
    return version if isinstance(version, str) else None


def _whole_manifest_version(raw: bytes, pace: Pace | None) -> str | None:
    try:
        document = decode_json(raw, pace)
    except (ValueError, RecursionError):
        return None
    version = document.get("store_version") if isinstance(document, dict) else None
    return version if isinstance(version, str) else None


def _store_version_of(raw: bytes, pace: Pace | None) -> str | None:
    try:
        version = decode_json_member(raw, "store_version", pace)
    except (KeyError, ValueError):  # no such member, not JSON, not an object: no version
        return None
    return str(version) if version is not None else None
