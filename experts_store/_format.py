"""One expert per safetensors file: tensors + the architecture as JSON in the header metadata.

Loading reads the file once into one host buffer, hashing each chunk right after it lands
(while it is still in the CPU cache) when a checksum is to be checked, and makes every
tensor a view into that buffer (CPU) or into one device copy of its data region (CUDA), so
a load costs one read, at most one pass of a hash over cached bytes and at most one
host-to-device copy; no pickle, no random init.

This module reads a file's bytes; the header and the views into the data are
`experts_store._header`, writing a file `experts_store._save`. It re-exports both, so that
the format has one import path.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from experts_store._checksum import Digest
from experts_store._exceptions import ExpertFileMissing, ExpertFormatError, ExpertLoadError
from experts_store._header import (
    FORMAT_VERSION,
    ExpertHeader,
    all_finite,
    dtype_name,
    expected_tensors,
    host_view,
    parse_header,
    tensor_views,
)
from experts_store._hostbuf import HostBufferPool, fresh_host_buffer
from experts_store._inside import opened_outside
from experts_store._save import ExpertFile, save_expert

__all__ = [
    "FORMAT_VERSION",
    "ExpertFile",
    "ExpertHeader",
    "expected_tensors",
    "all_finite",
    "dtype_name",
    "file_problem",
    "host_view",
    "parse_header",
    "read_expert_bytes",
    "save_expert",
    "sha256_hex",
    "tensor_views",
]

# Buffers from this size up come from the host pool (or a fresh huge-page mapping): a fresh
# anonymous buffer costs a page fault and a zeroing per page before the read can land, and on
# a quiet machine recycling already pays at 16 MiB (3.1 -> 2.5 ms, benchmarks/expert_load.py).
# Smaller ones stay on the heap, where the fixed costs dominate anyway.
_HUGE_PAGE_MIN_BYTES = 4 * 1024 * 1024
# A file read to be hashed is read in chunks this large, each hashed at once while it sits
# in the core's 1 MiB L2: XXH3 runs at ~80 GB/s there against ~30 GB/s once the buffer has
# left the caches. 0.5-1 MiB measured best for 16 and 128 MiB files (smaller chunks pay more
# read calls, 4 MiB spills out of L2); a second thread hashing behind the reader cost more
# than it hid on the 2-core VM (benchmarks/RESULTS.md, "fast checksum").
_HASH_CHUNK_BYTES = 512 * 1024


def sha256_hex(data: Any) -> str:
    """sha256 of a bytes-like object (hashlib releases the GIL on large buffers)."""
    return hashlib.sha256(data).hexdigest()


def read_expert_bytes(
    path: Path | str,
    *,
    expert_id: int | None = None,
    pin_memory: bool = False,
    host_pool: HostBufferPool | None = None,
    digests: Sequence[Digest] = (),
    expected_bytes: int | None = None,
    store_root: str | None = None,
) -> Tensor:
    """The whole file as one uint8 CPU tensor, read with a single unbuffered read loop.

    Buffers under 4 MiB come from the heap; larger ones from ``host_pool`` when given,
    else from a fresh huge-page mapping. Every byte read is fed to each of ``digests``, in
    file order, chunk by chunk as it lands. A file of another size than ``expected_bytes``
    (the manifest's) is refused before anything is read: a wrong file of gigabytes at an
    expert's name would otherwise be read and hashed whole before its checksum failed.
    ``store_root``: the store the file belongs to; a file that a symbolic link leads out of
    it is refused unread (ExpertFormatError naming the file and where it leads).
    """
    # A str path as given: building a Path costs ~6 µs, once per load of a small expert.
    try:
        # Not blocking: a FIFO at the path would hold the actor's thread, and every expert
        # behind it, for good. A regular file reads as without the flag.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise ExpertFileMissing(expert_id=expert_id, path=path) from exc
    except OSError as exc:
        raise ExpertLoadError(
            expert_id=expert_id, message=f"expert {expert_id}: cannot open {path}: {exc}"
        ) from exc
    try:
        if store_root is not None:
            outside = opened_outside(fd, path, store_root)
            if outside is not None:
                raise ExpertFormatError(
                    expert_id=expert_id,
                    # Not where it leads: this text reaches clients (a 503's reason).
                    reason=f"{path} is a link that leads outside the store",
                )
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ExpertFormatError(expert_id=expert_id, reason=f"{path} is not a regular file")
        size = st.st_size
        if expected_bytes is not None and size != expected_bytes:
            raise ExpertFormatError(
                expert_id=expert_id,
                reason=f"the file holds {size} bytes, the manifest says {expected_bytes}",
            )
        if pin_memory or size < _HUGE_PAGE_MIN_BYTES:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
        elif host_pool is not None:
            buf = host_pool.take(size)
        else:
            buf = fresh_host_buffer(size)
        view = host_view(buf)
        # Unhashed, one read call takes the whole file; hashed, chunks small enough to be
        # hashed from cache.
        step = _HASH_CHUNK_BYTES if digests else max(size, 1)
        done = 0
        while done < size:
            n = os.readv(fd, [view[done : done + step]])
            if not n:
                raise ExpertFormatError(expert_id=expert_id, reason="file shrank while read")
            for digest in digests:
                digest.update(view[done : done + n])
            done += n
    except OSError as exc:
        raise ExpertLoadError(
            expert_id=expert_id, message=f"expert {expert_id}: cannot read {path}: {exc}"
        ) from exc
    finally:
        os.close(fd)
    return buf


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a file ("no such file", "not a regular file"), or None.
    Asked before a reader that would open a FIFO and wait for a writer for good."""
    if path.is_file():
        return None
    return "not a regular file" if path.exists() else "no such file"

