"""Writing one expert file: `save_expert` writes an expert's tensors and its arch as a
safetensors file whose bytes depend on the expert alone, durably, and returns the figures a
manifest row records (`ExpertFile`)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from experts_store._arch import ExpertArch
from experts_store._checksum import fast_checksum, new_fast_digest
from experts_store._exceptions import StoreWriteError
from experts_store._header import DTYPES, FORMAT_VERSION, expected_tensors, host_view
from experts_store._model import ExpertMLP

__all__ = ["ExpertFile", "save_expert"]

_RESERVED_METADATA = ("format_version", "arch")


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
        if tensor.dtype != DTYPES[expected[name][0]]:
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
