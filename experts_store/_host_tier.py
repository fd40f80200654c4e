"""HostTier: verified expert files kept in (pinned) host memory, for a device that misses.

On a GPU a miss is bound by reading the file, not by the copy to the device: on an H100
machine one read out of the page cache ran at ~7 GB/s and its fast checksum at ~7 GB/s more,
against 49-53 GB/s for the pinned host-to-device copy (benchmarks/RESULTS.md, "The first GPU
session"). Host memory is usually many times a GPU's, so an actor may keep the bytes of the
experts it loaded, already verified and already pinned; loading one of them again is then the
copy alone. Keys are content hashes, as in the device cache, so a changed file is a new key.

The tier is a plain LRU with its own byte budget, outside the device budget (like PyTorch's
pinned-memory cache). A file larger than the whole budget is not kept. A pinned file counts
what it occupies: torch's pinned-memory allocator rounds every block up to a power of two
(`pinned_bytes`), so a file just over 16 MiB holds 32 MiB of page-locked memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from torch import Tensor

__all__ = ["HostTier", "HostTierStats", "pinned_bytes"]


def pinned_bytes(nbytes: int) -> int:
    """Host bytes a pinned tensor of `nbytes` occupies: torch's CachingHostAllocator rounds
    each allocation up to the next power of two (and keeps the block when it is freed)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


class HostTierStats:
    """Counts since the tier was made (read under no lock: a snapshot may be a call behind)."""

    __slots__ = ("evictions", "hits", "misses")

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.evictions = 0


class HostTier:
    """Thread-safe LRU of whole-file uint8 host tensors, at most `budget_bytes` in all."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host tier budget must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.stats = HostTierStats()
        # key -> (the file's bytes, the host bytes they occupy)
        self._entries: OrderedDict[str, tuple[Tensor, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def resident_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> Tensor | None:
        """The file bytes kept under `key` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry[0]

    def put(self, key: str, buf: Tensor) -> bool:
        """Keep `buf` (never written to again) under `key`, evicting the least recently used
        files until it fits; False when it is larger than the whole budget. A pinned `buf`
        counts the block it occupies (`pinned_bytes`), any other its own bytes."""
        size = buf.numel() * buf.element_size()
        if buf.is_pinned():
            size = pinned_bytes(size)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.budget_bytes:
                return False
            while self._bytes + size > self.budget_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                self.stats.evictions += 1
            self._entries[key] = (buf, size)
            self._bytes += size
            return True
