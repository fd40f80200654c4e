"""One expert per safetensors file: tensors + the architecture as JSON in the header metadata.

Loading reads the file once into one host buffer, hashing each chunk right after it lands
(while it is still in the CPU cache) when a checksum is to be checked, and makes every
tensor a view into that buffer (CPU) or into one device copy of its data region (CUDA), so
a load costs one read, at most one pass of a hash over cached bytes and at most one
host-to-device copy; no pickle, no random init.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import stat
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from experts_store._arch import ExpertArch
from experts_store._checksum import Digest, fast_checksum, new_fast_digest
from experts_store._exceptions import (
    ExpertFileMissing,
    ExpertFormatError,
    ExpertLoadError,
    StoreWriteError,
)
from experts_store._hostbuf import HostBufferPool, fresh_host_buffer
from experts_store._inside import opened_outside
from experts_store._model import ExpertMLP

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

logger = logging.getLogger(__name__)

# Version 2 added `activation` to the header's arch (ExpertArch.activation). A PReLU expert
# is still written as version 1, byte for byte as before (its arch JSON does not name the
# activation), so its content hash and store file name do not change and older readers
# keep reading it; any other activation is written as version 2, which an older reader
# refuses by its version instead of failing on an arch key it does not know. A version-1
# header is a PReLU expert: one that names another activation is refused.
FORMAT_VERSION: int = 2
_READABLE_VERSIONS = ("1", "2")

_RESERVED_METADATA = ("format_version", "arch")
# A header larger than this is not one of ours; refuse before allocating for it.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
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
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True)
class ExpertFile:
    """What :func:`save_expert` wrote: the figures a manifest row records.

    ``checksum`` is the fast checksum ``"xxh3_128:<hex>"`` of the file's bytes.
    """

    sha256: str
    bytes: int
    params: int
    arch: ExpertArch
    checksum: str | None = None


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


# (dtype, ((name, shape, strides, offset in elements), ...)): see ExpertHeader.uniform.
_Uniform = tuple[torch.dtype, tuple[tuple[str, tuple[int, ...], tuple[int, ...], int], ...]]


@dataclass(frozen=True)
class ExpertHeader:
    """A parsed and validated header: the arch and where each tensor lies in the data."""

    arch: ExpertArch
    metadata: dict[str, str]
    tensors: dict[str, TensorSpec]
    data_offset: int
    data_bytes: int
    # When every tensor has one dtype and starts on a multiple of its size: that dtype and
    # each tensor's (name, shape, contiguous strides, offset in elements), so tensor_views
    # makes each view with one as_strided (three or four ops per tensor otherwise).
    uniform: _Uniform | None = None


def expected_tensors(arch: ExpertArch) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (safetensors dtype, shape) of every tensor an expert file of ``arch`` holds."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    widths = arch.widths
    for j, (d_in, d_out) in enumerate(zip(widths, widths[1:], strict=False)):
        out[f"linears.{j}.weight"] = ("F32", (d_out, d_in))
        out[f"linears.{j}.bias"] = ("F32", (d_out,))
    for j, width in enumerate(arch.hidden_widths):
        if arch.activation == "prelu":
            out[f"activations.{j}.weight"] = ("F32", (width,))
        if arch.batchnorm:
            for leaf in ("weight", "bias", "running_mean", "running_var"):
                out[f"norms.{j}.{leaf}"] = ("F32", (width,))
            out[f"norms.{j}.num_batches_tracked"] = ("I64", ())
    return out


def host_view(buf: Tensor) -> memoryview:
    """Zero-copy bytes view of a contiguous uint8 CPU tensor."""
    return memoryview(buf.numpy())  # type: ignore[arg-type]


def sha256_hex(data: Any) -> str:
    """sha256 of a bytes-like object (hashlib releases the GIL on large buffers)."""
    return hashlib.sha256(data).hexdigest()


def save_expert(
    expert: ExpertMLP, path: Path | str, *, metadata: Mapping[str, str] | None = None
) -> ExpertFile:
    """Write ``expert`` (any device) to ``path`` as safetensors, durably, and return its figures.

    The file is written to a temporary sibling, fsynced and renamed, so ``path`` never holds
    a partial file.
    """
    path = Path(path)
    version = 1 if expert.arch.activation == "prelu" else FORMAT_VERSION
    header_meta = {"format_version": str(version), "arch": expert.arch.to_json()}
    for key, value in (metadata or {}).items():
        if key in _RESERVED_METADATA:
            raise ValueError(f"metadata key {key!r} is reserved")
        header_meta[str(key)] = str(value)
    state = {
        name: tensor.detach().to("cpu").contiguous() for name, tensor in expert.state_dict().items()
    }
    expected = expected_tensors(expert.arch)
    if set(state) != set(expected):
        raise ValueError("expert's tensors do not match its arch; was it modified in place?")
    for name, tensor in state.items():
        if tensor.dtype != _DTYPES[expected[name][0]]:
            # The format stores float32 parameters only; convert explicitly before saving.
            raise ValueError(f"{name} is {tensor.dtype}, the format stores float32 parameters")
        if not bool(torch.isfinite(tensor).all()):
            # A server would refuse to load it: refused here, before anything is published.
            # A store error, not a ValueError: the weights' fault, not the caller's code.
            raise StoreWriteError(
                path=path, reason=f"{name} holds NaN or infinite values (did its training diverge?)"
            )
    header, ordered = _serialize_header(state, header_meta, expected)
    digest = hashlib.sha256(header)
    fast = new_fast_digest()
    fast.update(header)
    size = len(header)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for tensor in ordered:
                chunk = host_view(tensor.reshape(-1).view(torch.uint8))
                digest.update(chunk)
                fast.update(chunk)
                f.write(chunk)
                size += chunk.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, a size limit, a read-only file system
        raise StoreWriteError.of(exc, path) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return ExpertFile(
        sha256=digest.hexdigest(),
        bytes=size,
        params=expert.arch.num_parameters(),
        arch=expert.arch,
        checksum=fast_checksum(fast),
    )


def _serialize_header(
    state: Mapping[str, Tensor],
    metadata: Mapping[str, str],
    expected: Mapping[str, tuple[str, tuple[int, ...]]],
) -> tuple[bytes, list[Tensor]]:
    """The safetensors header for ``state`` and the tensors in data order.

    Written here rather than by safetensors.torch.save so that the bytes are a function of
    the expert alone (the library orders metadata keys by hash map): the same expert gives
    the same file, hence the same content-addressed name in the store. Data order and
    padding follow the library (largest dtype first, then by name; header padded with
    spaces to 8 bytes), so every tensor is aligned.
    """
    ordered = sorted(state, key=lambda name: (-state[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name in ordered:
        tensor = state[name]
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": expected[name][0],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, [state[name] for name in ordered]


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


def parse_header(buf: Tensor | bytes, *, expert_id: int | None = None) -> ExpertHeader:
    """Parse and validate a safetensors header against the arch it declares."""
    raw = host_view(buf) if isinstance(buf, Tensor) else memoryview(buf)
    total = raw.nbytes
    if total < 8:
        raise ExpertFormatError(expert_id=expert_id, reason="file shorter than 8 bytes")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > min(_MAX_HEADER_BYTES, total - 8):
        raise ExpertFormatError(expert_id=expert_id, reason="header length out of range")
    header_bytes = bytes(raw[8 : 8 + header_len])
    try:
        return _parse_header_bytes(header_bytes, total)
    except _BadHeader as exc:
        raise ExpertFormatError(expert_id=expert_id, reason=exc.reason) from None


class _BadHeader(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# The experts of a store share one architecture, so their headers are byte-identical (same
# names, shapes, offsets and metadata): a parsed header is kept and reused for the next load.
# ExpertHeader is frozen and nothing mutates its dicts, so sharing one is safe.
@functools.lru_cache(maxsize=64)
def _parse_header_bytes(header_bytes: bytes, total: int) -> ExpertHeader:
    header_len = len(header_bytes)
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _BadHeader(f"header is not JSON: {exc}") from exc
    except RecursionError:  # a header of deeply nested arrays
        raise _BadHeader("header JSON nested too deeply") from None
    if not isinstance(header, dict):
        raise _BadHeader("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _BadHeader("header has no string metadata")
    version = metadata.get("format_version")
    if version not in _READABLE_VERSIONS:
        raise _BadHeader(
            f"format_version {version!r}, expected one of {', '.join(_READABLE_VERSIONS)}",
        )
    try:
        arch = ExpertArch.from_json(metadata.get("arch", ""))
    except ValueError as exc:
        raise _BadHeader(f"bad arch metadata: {exc}") from exc
    if version == "1" and arch.activation != "prelu":
        raise _BadHeader(f"format_version 1 holds PReLU experts, the arch says {arch.activation}")
    data_offset = 8 + header_len
    data_bytes = total - data_offset
    tensors: dict[str, TensorSpec] = {}
    expected = expected_tensors(arch)
    missing = sorted(set(expected) - set(header))
    extra = sorted(set(header) - set(expected))
    if missing or extra:
        raise _BadHeader(f"tensors missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (want_dtype, want_shape) in expected.items():
        info = header[name]
        try:
            dtype, shape = info["dtype"], tuple(int(s) for s in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _BadHeader(f"{name}: malformed tensor entry") from exc
        if dtype != want_dtype:
            raise _BadHeader(f"{name}: dtype {dtype}, expected {want_dtype}")
        if shape != want_shape:
            raise _BadHeader(
                f"{name}: shape {list(shape)}, expected {list(want_shape)}",
            )
        numel = 1
        for s in shape:
            numel *= s
        itemsize = _DTYPES[dtype].itemsize
        if not 0 <= start <= end <= data_bytes or end - start != numel * itemsize:
            raise _BadHeader(f"{name}: data offsets out of range")
        tensors[name] = TensorSpec(dtype=dtype, shape=shape, start=start, end=end)
    return ExpertHeader(
        arch=arch,
        metadata={k: v for k, v in metadata.items()},
        tensors=tensors,
        data_offset=data_offset,
        data_bytes=data_bytes,
        uniform=_uniform_layout(tensors, data_bytes),
    )


def _uniform_layout(tensors: dict[str, TensorSpec], data_bytes: int) -> _Uniform | None:
    dtypes = {spec.dtype for spec in tensors.values()}
    if len(dtypes) != 1:
        return None
    dtype = _DTYPES[dtypes.pop()]
    size = dtype.itemsize
    if data_bytes % size or any(spec.start % size for spec in tensors.values()):
        return None
    layout = []
    for name, spec in tensors.items():
        strides = [1] * len(spec.shape)
        for i in range(len(spec.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * spec.shape[i + 1]
        layout.append((name, spec.shape, tuple(strides), spec.start // size))
    return dtype, tuple(layout)


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a file ("no such file", "not a regular file"), or None.
    Asked before a reader that would open a FIFO and wait for a writer for good."""
    if path.is_file():
        return None
    return "not a regular file" if path.exists() else "no such file"


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype ("F32"), for errors that compare with a header."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def all_finite(data: Tensor, header: ExpertHeader) -> bool:
    """Whether every float32 value of the header's tensors in `data` (the file past its
    header, uint8, on any device) is a number. One NaN weight makes every output it reaches
    NaN, which a server could only blame on the input.

    One aminmax per contiguous run of tensors (NaN propagates to both ends, ±inf is one of
    them): 22 µs for a 0.55 MB expert, 0.45 ms for 12.9 MB on one core, where a check per
    tensor paid ~10 µs of dispatch each, and a float64 sum (which no float32 overflows)
    took three times as long.
    """
    runs: list[list[int]] = []
    for start, end in sorted((spec.start, spec.end) for spec in header.tensors.values()):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    chunks = [data[start:end] for start, end in runs]
    if any(start % 4 or (end - start) % 4 for start, end in runs) or any(
        chunk.storage_offset() % 4 for chunk in chunks
    ):
        # Overlapping or unaligned tensors (the format allows them): each on its own.
        chunks = list(tensor_views(data, header).values())
    ends = [torch.aminmax(chunk.view(torch.float32)) for chunk in chunks if chunk.numel()]
    if not ends:
        return True
    if len(ends) == 1:
        low, high = ends[0]
    else:
        low = torch.stack([end.min for end in ends]).min()  # NaN propagates through both
        high = torch.stack([end.max for end in ends]).max()
    return math.isfinite(low.item()) and math.isfinite(high.item())


def tensor_views(data: Tensor, header: ExpertHeader) -> dict[str, Tensor]:
    """The header's tensors as views into data (no copy)."""
    uniform = header.uniform
    if uniform is not None and data.numel() == header.data_bytes:
        dtype, layout = uniform
        if data.storage_offset() % dtype.itemsize == 0:
            flat = data.view(dtype)
            base = flat.storage_offset()
            return {
                name: flat.as_strided(shape, strides, base + offset)
                for name, shape, strides, offset in layout
            }
    state: dict[str, Tensor] = {}
    for name, spec in header.tensors.items():
        dtype = _DTYPES[spec.dtype]
        chunk = data[spec.start : spec.end]
        itemsize = dtype.itemsize
        if (chunk.storage_offset() % itemsize) != 0:
            # safetensors writers align tensors, but the format does not promise it.
            chunk = chunk.clone()
        state[name] = chunk.view(dtype).reshape(spec.shape)
    return state
