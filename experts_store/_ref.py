"""ExpertRef: a content-addressed handle on one expert file, and the loader that reads it.

A serving actor does not open a store: each call names the experts it needs by `ExpertRef`,
built by the server from the store version the request entered. The ref is also the key of
the actor's cache. Its equality and hash are the file's sha256 alone, so one expert published
unchanged in two store versions (or under another id) is one cache entry, counted once
against the budget and warm across the swap, while a changed expert is a new key that cannot
be confused with the old one.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from experts_store._checksum import known_checksum
from experts_store._exceptions import ExpertFormatError
from experts_store._frozen import FrozenExpert
from experts_store._host_tier import HostTier
from experts_store._hostbuf import HostBufferPool
from experts_store._load import load_frozen_expert, read_checked_bytes, state_from_bytes
from experts_store._recent import RecentKeys

__all__ = ["ExpertRef", "ExpertRefLoader"]

# Contents a loader remembers as checked, per generation (`RecentKeys`): a K=100,000 store's
# every expert, and at most ~40 MB per set. Unbounded, the sets grew with every content an
# actor ever loaded: a server hot-swapping retrained stores for weeks held them all. A content
# forgotten is checked again on its next load, as on its first.
_REMEMBERED_CONTENTS = 1 << 17


@dataclass(frozen=True)
class ExpertRef:
    """One expert as a cache key (its sha256) plus what it takes to load it."""

    sha256: str
    path: str = field(compare=False)
    nbytes: int = field(compare=False)  # bytes on the device once loaded
    expert_id: int = field(compare=False)  # named by errors; ids are per store version
    checksum: str | None = field(default=None, compare=False)  # fast checksum, when published
    file_bytes: int | None = field(default=None, compare=False)  # the manifest's file size

    @property
    def key(self) -> str:
        return self.sha256


class ExpertRefLoader:
    """The `ExpertLoader` of a serving actor's cache: reads an `ExpertRef` onto `device`.

    Every load is verified against the ref's fast checksum (xxh3, hashed as the file is read),
    so a corrupted or swapped file is refused naming the expert even after a good first read.
    A ref without one this reader knows (a store published before checksums) is verified
    against its sha256 on the first load of that content, as a `Store` does. A file that a
    symbolic link leads out of its store is refused unread, naming it (on a content's first
    load where later loads must match its fast checksum, so a link swapped in reads only
    that content; on every load of a ref without one). CPU loads of large experts recycle
    freed host buffers; the pool parks at most two of the largest expert seen.

    On a CUDA device, `host_tier` (when given) keeps each file's verified bytes in pinned host
    memory after its load, and a later load of the same content is the host-to-device copy
    alone: no read, no checksum (`HostTier`). On CPU the device memory is host memory, so a
    tier would only hold every expert twice: it is refused.
    """

    def __init__(
        self, device: str | torch.device = "cpu", *, host_tier: HostTier | None = None
    ) -> None:
        self.device = torch.device(device)
        if host_tier is not None and self.device.type != "cuda":
            raise ValueError(f"a host tier serves CUDA devices only, not {self.device}")
        self.host_tier = host_tier
        self._verified = RecentKeys(_REMEMBERED_CONTENTS)
        # Contents whose weights were seen finite. The check costs about a read of the bytes
        # from cache (benchmarks/RESULTS.md, sixty-fifth session), so it runs on a content's
        # first load only: later loads check the bytes against the fast checksum, so they
        # are the bytes seen then (a store published before checksums is checked against
        # its sha256 on the first load only, as its bytes are). Bounded like `_verified`.
        self._finite = RecentKeys(_REMEMBERED_CONTENTS)
        self._lock = threading.Lock()
        self._host_pool = HostBufferPool(0) if self.device.type == "cpu" else None

    def nbytes(self, ref: ExpertRef) -> int:
        return ref.nbytes

    def load(self, ref: ExpertRef) -> FrozenExpert:
        fast = known_checksum(ref.checksum)
        with self._lock:
            verified = fast or ref.sha256 in self._verified
            seen_finite = ref.sha256 in self._finite
            if self._host_pool is not None:
                self._host_pool.max_bytes = max(self._host_pool.max_bytes, 2 * ref.nbytes)
        # Where a link leads is judged on a content's first load, like its finiteness, when
        # every later load is checked against the fast checksum: a link swapped in since then
        # reads nothing but that content (judged on every load it cost ~7 % of an actor's
        # CPU on the workload: RESULTS.md, "Sixty-seventh session"). A ref without a
        # known fast checksum is read unchecked after its first load: judged every time.
        root = None if seen_finite and fast else _store_root(ref.path)
        if self.host_tier is not None:
            expert = self._through_tier(
                self.host_tier, ref, fast=fast, verified=verified, check_finite=not seen_finite,
                store_root=root,
            )
        else:
            expert = load_frozen_expert(
                ref.path,
                self.device,
                expected_checksum=ref.checksum if fast else None,
                expected_sha256=None if verified else ref.sha256,
                expert_id=ref.expert_id,
                host_pool=self._host_pool,
                expected_bytes=ref.file_bytes,
                check_finite=not seen_finite,
                store_root=root,
            )
        if expert.arch.nbytes() != ref.nbytes:
            raise ExpertFormatError(
                expert_id=ref.expert_id, reason="file's arch differs from the manifest's"
            )
        if not (seen_finite and verified):
            with self._lock:
                self._finite.add(ref.sha256)
                if not verified:
                    self._verified.add(ref.sha256)
        return expert

    def _through_tier(
        self,
        tier: HostTier,
        ref: ExpertRef,
        *,
        fast: bool,
        verified: bool,
        check_finite: bool,
        store_root: str | None,
    ) -> FrozenExpert:
        kept = tier.get(ref.sha256)
        # Read and checked as without a tier, and kept only once it checked and parsed.
        buf = kept if kept is not None else read_checked_bytes(
            ref.path,
            expected_checksum=ref.checksum if fast else None,
            expected_sha256=None if verified else ref.sha256,
            expert_id=ref.expert_id,
            pin_memory=True,
            expected_bytes=ref.file_bytes,
            store_root=store_root,
        )
        arch, state = state_from_bytes(
            buf, self.device, expert_id=ref.expert_id, pinned=True, check_finite=check_finite
        )
        if kept is None and arch.nbytes() == ref.nbytes:
            tier.put(ref.sha256, buf)
        return FrozenExpert(arch, state)


def _store_root(path: str) -> str:
    # A ref's file is <store root>/experts/<id>-<hash>.safetensors (`Store.expert_ref`, from
    # the manifest's derived name): two string cuts, not a field each ref carries to actors.
    return os.path.dirname(os.path.dirname(path))
