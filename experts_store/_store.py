"""Store: the read side of a published store directory."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from experts_store._checksum import FAST_CHECKSUM_ALGO, ExpectedDigest, known_checksum
from experts_store._exceptions import (
    ExpertFormatError,
    ExpertLoadError,
    ManifestError,
    StoreError,
)
from experts_store._format import all_finite, parse_header, read_expert_bytes
from experts_store._frozen import FrozenExpert
from experts_store._hostbuf import HostBufferPool
from experts_store._hypernet import verify_hyper_files
from experts_store._inside import resolves_outside
from experts_store._live import read_manifest_file
from experts_store._load import load_expert, load_frozen_expert
from experts_store._manifest import (
    LINEAR_LIFT_EXTRA_DIMS,
    STORE_KINDS,
    ExpertEntry,
    Manifest,
    ManifestRows,
    read_manifest_rows,
)
from experts_store._model import ExpertMLP
from experts_store._pace import Pace, no_pace
from experts_store._ref import ExpertRef
from experts_store._store_checks import StoreProblem, check_router_file, regular_file_size
from experts_store._writer import REPORT_NAME

__all__ = ["Store", "StoreExpertLoader", "StoreProblem", "read_report"]

logger = logging.getLogger(__name__)

_E = TypeVar("_E", ExpertMLP, FrozenExpert)


class Store:
    """A published store, pinned to the manifest read at :meth:`open`.

    Thread-safe. An expert whose manifest row has a fast ``checksum`` is checked against it
    on every load (it adds 15-25% to a load), so a file corrupted or replaced
    after its first read is still refused. A row without one (a store published before
    checksums existed, or naming an algorithm this reader lacks) has its sha256 checked on
    the first load through this object; later loads trust the content-addressed file. CPU
    loads of large experts reuse the host buffers of freed ones through ``host_pool`` (see
    HostBufferPool).
    """

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        *,
        host_pool: HostBufferPool | None = None,
        pace: Pace = no_pace,
        rows: ManifestRows | None = None,
    ) -> None:
        # Absolute: expert paths leave this process for Ray actors, whose working directory
        # is not ours on another node, and `./store` would name another folder there.
        self.root = Path(root).absolute()
        self.manifest = manifest
        self.host_pool = host_pool
        self.manifest_rows = rows  # what `open(previous=self)` takes unchanged rows from
        # `expert_refs`' refs, made once; and a previous store's rows and refs, to take the
        # ref of each row taken from it (`open(previous=...)`), dropped once used.
        self.refs: list[ExpertRef] | None = None
        self._prior_refs: tuple[list[ExpertEntry], list[ExpertRef]] | None = None
        self._verified: set[int] = set()
        self._lock = threading.Lock()
        algos: set[str] = set()
        fast = f"{FAST_CHECKSUM_ALGO}:"  # every row a store's writer records: no regex for it
        for e in manifest.experts:
            pace()
            checksum = e.checksum
            if checksum is not None and not checksum.startswith(fast):
                if not known_checksum(checksum):
                    algos.add(checksum.partition(":")[0])
        unknown = sorted(algos)
        if unknown:
            logger.warning(
                "store %s: checksum algorithm(s) %s unknown to this reader; those experts are "
                "checked by sha256 on first read only",
                root,
                ", ".join(unknown),
            )

    @classmethod
    def open(
        cls,
        root: Path | str,
        *,
        host_pool_bytes: int | None = None,
        pace: Pace | None = None,
        previous: Store | None = None,
    ) -> Store:
        """Read ``root``'s manifest. ``host_pool_bytes`` bounds the freed expert buffers kept
        for reuse (default: two of the store's largest experts; 0 disables the pool).
        ``pace`` is called once per expert in each pass over the manifest's rows (`Pacer`:
        a server opening a new version beside its event loop). ``previous``: a store this one
        replaces (the version a server serves), whose rows are taken where their text in the
        manifest is unchanged (`read_manifest_rows`).

        ManifestError for a manifest it cannot read or that is not valid (one of more than
        MAX_MANIFEST_BYTES is refused unread), and for a manifest.json, router or kind's
        file that a symbolic link leads out of ``root`` (experts' files are refused when
        loaded: a store may have 100,000)."""
        root = Path(root)
        raw = read_manifest_file(root)
        manifest, rows = read_manifest_rows(
            raw,
            pace=pace,
            previous=previous.manifest_rows if previous is not None else None,
            root=root,
        )
        for name in sorted(manifest.non_expert_files):
            outside = resolves_outside(root / name, root)
            if outside is not None:
                # Not where it leads: a reload's 503 reason shows this text to its caller.
                raise ManifestError(
                    root=root, message=f"{name} is a link that leads outside the store"
                )
        if host_pool_bytes is None:
            host_pool_bytes = 2 * manifest.max_expert_bytes
        pool = HostBufferPool(host_pool_bytes) if host_pool_bytes > 0 else None
        store = cls(root, manifest, host_pool=pool, pace=pace or no_pace, rows=rows)
        if (
            manifest.experts  # a store without rows (kind hyper) would keep them for nothing
            and previous is not None
            and previous.root == store.root
            and previous.refs is not None
        ):
            # Snapshots: a retired version's release empties the lists it holds.
            store._prior_refs = (list(previous.manifest.experts), list(previous.refs))
        return store

    @property
    def version(self) -> str:
        return self.manifest.store_version

    def node_router_path(self, node: str) -> Path:
        """The router file of graph node `node` (KeyError if the store has no such node)."""
        if self.manifest.graph is None:
            raise KeyError(node)
        return self.root / self.manifest.graph.node(node).router_file

    @property
    def router_path(self) -> Path:
        """The router's file; StoreError for a store that has none (a hyper store that
        takes its conditions from requests)."""
        if self.manifest.router_file is None:
            raise StoreError(f"store {self.root} of kind {self.manifest.kind} has no router")
        return self.root / self.manifest.router_file

    def expert_entry(self, expert_id: int) -> ExpertEntry:
        return self.manifest.expert(expert_id)

    def expert_path(self, expert_id: int) -> Path:
        return self.root / self.expert_entry(expert_id).file

    def expert_ref(self, expert_id: int) -> ExpertRef:
        """The content-addressed handle a serving actor loads this expert by."""
        return self._ref(self.expert_entry(expert_id), f"{self.root}{os.sep}")

    def _ref(self, entry: ExpertEntry, prefix: str, nbytes: int | None = None) -> ExpertRef:
        # Positional, and the path a string join onto `prefix` (the root and a separator),
        # not pathlib's: a K=100,000 store makes 100,000 refs per version. `file` is the
        # manifest's derived "experts/<id>-<hash>.safetensors", checked when it was read.
        if nbytes is None:
            nbytes = entry.expert_arch.nbytes()
        return ExpertRef(
            entry.sha256, prefix + entry.file, nbytes, entry.id, entry.checksum, entry.bytes
        )

    def expert_refs(self, pace: Pace = no_pace) -> list[ExpertRef]:
        """`expert_ref` of every expert, in id order (a new list each call; the refs are made
        once, and kept in `refs`). `pace` is called once per expert the first time. A row
        taken from the store this one was opened after (`open(previous=...)`) takes its ref."""
        if self.refs is None:
            prior, self._prior_refs = self._prior_refs, None
            prefix = f"{self.root}{os.sep}"
            refs = []
            entries, prior_refs = prior if prior is not None else ([], [])
            known = min(len(entries), len(prior_refs))
            # Rows of one arch share its dict: its bytes are asked when the dict changes.
            arch_dict: dict[str, object] | None = None
            nbytes = 0
            for i, entry in enumerate(self.manifest.experts):
                pace()
                if i < known and entry is entries[i]:
                    refs.append(prior_refs[i])
                    continue
                if entry.arch is not arch_dict:
                    arch_dict, nbytes = entry.arch, entry.expert_arch.nbytes()
                refs.append(self._ref(entry, prefix, nbytes))
            self.refs = refs
        return list(self.refs)

    def expert_nbytes(self, expert_id: int) -> int:
        """Bytes the expert's parameters and buffers occupy on a device once loaded."""
        return self.expert_entry(expert_id).expert_arch.nbytes()

    def load_expert(self, expert_id: int, device: str | torch.device = "cpu") -> ExpertMLP:
        return self._load(expert_id, device, load_expert)

    def load_frozen(self, expert_id: int, device: str | torch.device = "cpu") -> FrozenExpert:
        """The expert for inference only (FrozenExpert): what serving holds in its cache."""
        return self._load(expert_id, device, load_frozen_expert)

    def _load(
        self, expert_id: int, device: str | torch.device, loader: Callable[..., _E]
    ) -> _E:
        entry = self.expert_entry(expert_id)
        fast = known_checksum(entry.checksum)
        with self._lock:
            verified = fast or entry.id in self._verified
        expert = loader(
            self.root / entry.file,
            device,
            expected_checksum=entry.checksum if fast else None,
            expected_sha256=None if verified else entry.sha256,
            expert_id=entry.id,
            host_pool=self.host_pool,
            store_root=str(self.root),
        )
        if expert.arch.to_dict() != entry.arch:
            raise ExpertFormatError(
                expert_id=entry.id, reason="file's arch differs from the manifest's"
            )
        if not verified:
            with self._lock:
                self._verified.add(entry.id)
        return expert

    def verify(self, progress: Callable[[int], None] | None = None) -> list[StoreProblem]:
        """Check every file's presence, sha256 and header; an empty list means all hold.

        An expert's fast checksum, when its row has one this reader knows, is checked too
        (in the same pass over the file). ``progress``, when given, is called with each
        expert's manifest bytes once that expert is checked, passed or failed: reading a
        large store takes minutes (26 GiB in 48 s on the development VM).
        """
        problems: list[StoreProblem] = []
        routers: list[tuple[str, str]] = []
        if self.manifest.router_file is not None:
            routers.append(("router", self.manifest.router_file))
        if self.manifest.graph is not None:
            # A graph store's nodes route with routers of their own: each is checked too.
            routers += [(f"node {n.name!r} router", n.router_file)
                        for n in self.manifest.graph.nodes]
        if self.manifest.kind not in STORE_KINDS:
            problems.append(StoreProblem(
                None, f"store kind {self.manifest.kind!r} is not one momlp serves "
                f"({', '.join(sorted(STORE_KINDS))})"
            ))
        for who, name in routers:
            # The top router of a momlp store holds one prototype per expert, in input space
            # (a linear gate's rows, lifted, have a few coordinates more).
            lifted = LINEAR_LIFT_EXTRA_DIMS if self.manifest.gate_spec.lift == "linear" else 0
            expect = (
                (self.manifest.num_experts, self.manifest.input_dim + lifted)
                if who == "router" and self.manifest.kind == "momlp" else None
            )
            # A pmoe store's router may be a learned linear map, not a tree of prototypes.
            tree = self.manifest.kind != "pmoe"
            problem = check_router_file(self.root / name, who, tree=tree, expect=expect)
            if problem is not None:
                problems.append(problem)
        if self.manifest.hyper is not None:
            found = verify_hyper_files(self.root, self.manifest.hyper)
            problems += [StoreProblem(None, message) for message in found]
        for entry in self.manifest.experts:
            try:
                size = regular_file_size(self.root / entry.file)
                if size is not None and size != entry.bytes:
                    # The budget and the pool's plans trust the manifest's figure. Told
                    # before the read: a wrong file of gigabytes is not read whole.
                    problems.append(StoreProblem(
                        entry.id, f"manifest says {entry.bytes} bytes, the file holds {size}"
                    ))
                    continue
                sha256 = hashlib.sha256()
                fast = (
                    ExpectedDigest(entry.checksum, expert_id=entry.id)
                    if entry.checksum is not None and known_checksum(entry.checksum)
                    else None
                )
                buf = read_expert_bytes(
                    self.root / entry.file,
                    expert_id=entry.id,
                    digests=(sha256,) if fast is None else (sha256, fast.digest),
                    store_root=str(self.root),
                )
                if buf.numel() != entry.bytes:  # it changed since the stat
                    problems.append(StoreProblem(
                        entry.id, f"manifest says {entry.bytes} bytes, the file holds "
                        f"{buf.numel()}"
                    ))
                    continue
                actual = sha256.hexdigest()
                if actual != entry.sha256:
                    problems.append(
                        StoreProblem(
                            entry.id,
                            f"checksum mismatch: manifest {entry.sha256[:16]}..., "
                            f"file {actual[:16]}...",
                        )
                    )
                    continue
                if fast is not None:
                    fast.check()
                header = parse_header(buf, expert_id=entry.id)
                if header.arch.to_dict() != entry.arch:
                    problems.append(StoreProblem(entry.id, "file's arch differs from manifest"))
                    continue
                if not all_finite(buf[header.data_offset :], header):
                    # A server refuses to load it (503): outputs would be NaN.
                    problems.append(StoreProblem(
                        entry.id, "its weights hold NaN or infinite values"
                    ))
            except ExpertLoadError as exc:
                problems.append(StoreProblem(entry.id, exc.message))
            finally:
                if progress is not None:
                    progress(entry.bytes)
        return problems

    def report(self) -> dict[str, Any] | None:
        """report.json of the build of this version, or None when the store has none (or
        only another version's, left by a publish cut short)."""
        return read_report(self.root, self.version)


def read_report(root: Path, version: str) -> dict[str, Any] | None:
    """The report.json in `root` if it is the one of `version`, else None: none, unreadable,
    or another version's (a later publish's, or one a publish cut short left behind)."""
    try:
        data = json.loads((root / REPORT_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        logger.warning("unreadable %s in %s", REPORT_NAME, root)
        return None
    if not isinstance(data, dict):
        return None
    described = data.get("store_version")  # absent in reports written before it was
    if described is not None and described != version:
        logger.warning("%s in %s describes version %s, not %s: ignored",
                       REPORT_NAME, root, described, version)
        return None
    return data


class StoreExpertLoader:
    """The :class:`ExpertLoader` an :class:`ExpertCache` needs, reading from a Store."""

    def __init__(self, store: Store, device: str | torch.device = "cpu") -> None:
        self.store = store
        self.device = torch.device(device)

    def nbytes(self, expert_id: int) -> int:
        return self.store.expert_nbytes(expert_id)

    def load(self, expert_id: int) -> ExpertMLP:
        return self.store.load_expert(expert_id, self.device)
