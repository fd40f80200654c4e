"""HostBufferPool: recycle the large host buffers that CPU experts live in.

A fresh anonymous mapping makes the kernel fault in and zero every page before the file's
bytes can be read into it; on a VM that doubles the cost of loading a large expert. When
an ExpertCache evicts one expert to load another of the same size (the common case: a
store's experts share one architecture), the pool hands the evicted expert's buffer to
the new one, so the load costs one read from the page cache and nothing else. As in
PyTorch's CUDA caching allocator, the memory parked here is outside any cache budget;
``max_bytes`` bounds it.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref

import torch
from torch import Tensor

__all__ = ["HUGE_PAGE_BYTES", "HostBufferPool", "fresh_host_buffer"]

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 1024 * 1024


def _mapping(size: int) -> mmap.mmap:
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            # 2 MiB pages: 512 times fewer faults than 4 KiB pages.
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            logger.debug("transparent huge pages unavailable; using 4 KiB pages")
    return mapping


def fresh_host_buffer(size: int) -> Tensor:
    """An uninitialised uint8 tensor in a new huge-page-advised anonymous mapping."""
    return torch.frombuffer(_mapping(max(size, 1)), dtype=torch.uint8)[:size]


class HostBufferPool:
    """Thread-safe pool of page-aligned host buffers, keyed by size rounded to 2 MiB.

    ``take(size)`` returns a uint8 tensor; when every tensor viewing it (an expert's
    parameters) is gone, its mapping comes back here for the next ``take`` of that size,
    unless the pool already parks ``max_bytes``, in which case it is unmapped.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        # Reentrant: a give-back runs whenever a tensor dies, possibly inside take().
        self._lock = threading.RLock()
        self.reused = 0
        self.created = 0

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes

    def take(self, size: int) -> Tensor:
        rounded = max(HUGE_PAGE_BYTES, -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
        with self._lock:
            parked = self._free.get(rounded)
            if parked:
                mapping = parked.pop()
                self._free_bytes -= rounded
                self.reused += 1
            else:
                mapping = None
                self.created += 1
        if mapping is None:
            mapping = _mapping(rounded)
        view = memoryview(mapping)
        # The memoryview is what the tensor's storage holds; it dies with the last view.
        finalizer = weakref.finalize(view, self._give_back, mapping)
        # At interpreter exit the process unmaps everything anyway.
        finalizer.atexit = False
        return torch.frombuffer(view, dtype=torch.uint8)[:size]

    def clear(self) -> None:
        with self._lock:
            parked = [m for ms in self._free.values() for m in ms]
            self._free.clear()
            self._free_bytes = 0
        for mapping in parked:
            mapping.close()

    def _give_back(self, mapping: mmap.mmap) -> None:
        size = len(mapping)
        with self._lock:
            if self._free_bytes + size <= self.max_bytes:
                self._free.setdefault(size, []).append(mapping)
                self._free_bytes += size
                return
        try:
            mapping.close()
        except BufferError:
            # Still exported somewhere; the mapping is unmapped when that view goes.
            logger.debug("host buffer still exported; leaving it to the garbage collector")
