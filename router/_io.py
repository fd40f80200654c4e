"""The router file: safetensors arrays plus string metadata; nothing is ever unpickled."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from ._build import TreeArrays
from ._exceptions import RouterFileError

__all__ = ["FILE_FORMAT", "FILE_VERSION", "read_router", "write_router"]

FILE_FORMAT = "momlp-router"
FILE_VERSION = "1"
SPLIT_BALANCED = "balanced"  # metadata "split": absent = Voronoi cells (the default build)


def _canonical(data: bytes) -> bytes:
    """`data`, a safetensors file, with its JSON header's keys in sorted order.

    safetensors writes the metadata in a hash map's random order, so one router written twice
    gave two files, two sha256 and two file names: a rebuild with the same seed, or a republish
    of an unchanged router, made a new router file. The arrays' offsets are relative to the
    data, so only the header changes; it stays padded with spaces to a multiple of 8 bytes.
    """
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + length :]


def write_router(
    path: Path | str,
    prototypes: torch.Tensor,
    arrays: TreeArrays,
    branching: int,
    temperature: float,
    balanced: bool = False,
) -> None:
    """Write atomically: a reader never sees a half-written router."""
    target = Path(path)
    tensors = {
        "prototypes": prototypes.contiguous(),
        "internal_points": arrays.points.contiguous(),
        "internal_radius": arrays.radius.contiguous(),
        "children": arrays.children.contiguous(),
    }
    metadata = {
        "format": FILE_FORMAT,
        "format_version": FILE_VERSION,
        "branching": str(branching),
        "temperature": repr(float(temperature)),
    }
    if balanced:
        # Only balanced trees carry the key, so default routers' files stay byte-identical.
        metadata["split"] = SPLIT_BALANCED
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    # Serialised in memory and written with open() rather than save_file, which creates
    # its file 0600: on shared storage a server running as another user must read the
    # router like the manifest and experts (0666 less the umask, as experts_store writes).
    data = _canonical(save(tensors, metadata=metadata))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _fail(path: Path, message: str) -> RouterFileError:
    return RouterFileError(path=path, message=message)


def read_router(path: Path | str) -> tuple[torch.Tensor, TreeArrays, int, float, bool]:
    """Read and check a router file: (prototypes, arrays, branching, temperature,
    balanced)."""
    p = Path(path)
    if not p.is_file():
        raise _fail(p, "no such file")
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as exc:
        raise _fail(p, f"not a readable safetensors file ({exc})") from exc
    if metadata.get("format") != FILE_FORMAT:
        raise _fail(p, f"format is {metadata.get('format')!r}, expected {FILE_FORMAT!r}")
    if metadata.get("format_version") != FILE_VERSION:
        raise _fail(p, f"unsupported format_version {metadata.get('format_version')!r}")
    try:
        branching = int(metadata["branching"])
        temperature = float(metadata["temperature"])
    except (KeyError, ValueError) as exc:
        raise _fail(p, f"bad metadata ({exc})") from exc
    split = metadata.get("split")
    if split not in (None, SPLIT_BALANCED):
        raise _fail(p, f"unknown split {split!r}")
    if branching < 2:
        raise _fail(p, f"branching must be >= 2, got {branching}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise _fail(p, f"temperature must be finite and > 0, got {temperature}")
    expected = {
        "prototypes": torch.float32,
        "internal_points": torch.float32,
        "internal_radius": torch.float64,
        "children": torch.int64,
    }
    for name, dtype in expected.items():
        if name not in tensors:
            raise _fail(p, f"missing tensor {name!r}")
        if tensors[name].dtype != dtype:
            raise _fail(p, f"tensor {name!r} has dtype {tensors[name].dtype}, expected {dtype}")
    protos = tensors["prototypes"]
    points = tensors["internal_points"]
    radius = tensors["internal_radius"]
    children = tensors["children"]
    if protos.dim() != 2 or protos.shape[0] < 1 or protos.shape[1] < 1:
        raise _fail(p, f"prototypes must be [K >= 1, n >= 1], got {list(protos.shape)}")
    k, n = protos.shape
    m = points.shape[0] if points.dim() == 2 else -1
    if points.dim() != 2 or points.shape[1] != n:
        raise _fail(p, f"internal_points must be [M, {n}], got {list(points.shape)}")
    if radius.shape != (m,) or children.shape != (m, branching):
        raise _fail(p, "internal_radius / children shapes disagree with internal_points")
    if (k == 1) != (m == 0):
        raise _fail(p, f"{k} prototypes need {'no' if k == 1 else 'some'} internal nodes")
    _check_structure(p, children, m, k)
    if not bool(torch.isfinite(protos).all() and torch.isfinite(points).all()):
        raise _fail(p, "non-finite prototype or node point")
    if not bool((torch.isfinite(radius) & (radius >= 0)).all()):
        raise _fail(p, "radii must be finite and >= 0")
    arrays = TreeArrays(points, radius, children)
    return protos, arrays, branching, temperature, split == SPLIT_BALANCED


def _check_structure(p: Path, children: torch.Tensor, m: int, k: int) -> None:
    """A tree: every node but the root has one parent, ids grow downwards, slots packed."""
    if m == 0:
        return
    if bool(((children < -1) | (children >= m + k)).any()):
        raise _fail(p, "child id out of range")
    valid = children >= 0
    if not bool(valid[:, 0].all()):
        raise _fail(p, "an internal node has no children")
    # Padding only at the end of a row: once -1, always -1.
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise _fail(p, "children rows must be packed (-1 only at the end)")
    parent = torch.arange(m)[:, None].expand_as(children)
    if bool((valid & (children < m) & (children <= parent)).any()):
        raise _fail(p, "an internal child id must exceed its parent's (breadth-first order)")
    counts = torch.bincount(children[valid], minlength=m + k)
    expected = torch.ones(m + k, dtype=counts.dtype)
    expected[0] = 0
    if not bool((counts == expected).all()):
        raise _fail(p, "every node except the root must be the child of exactly one node")
