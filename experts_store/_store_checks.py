"""What `Store.verify` reports (`StoreProblem`), and its checks of the files beside the
experts: a router's file, judged by its name's hash and its header, and whether a path is a
regular file (a FIFO's read would block)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from experts_store._format import sha256_hex

__all__ = ["StoreProblem", "check_router_file", "regular_file_size"]


@dataclass(frozen=True)
class StoreProblem:
    """One finding of :meth:`Store.verify`; ``expert_id`` is None for the router/manifest."""

    expert_id: int | None
    message: str


def regular_file_size(path: Path) -> int | None:
    """The size of the regular file at `path`; None for anything else (missing, a FIFO),
    which the read that follows reports."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def check_router_file(
    path: Path, who: str, *, tree: bool = True, expect: tuple[int, int] | None = None
) -> StoreProblem | None:
    """A problem if the router file is missing, unreadable, not its name's hash, not a
    safetensors file, without a 2-D float32 `prototypes` array (`tree`: a prototype tree's
    file), or (`expect`: [K, n]) of another shape than the manifest's experts and inputs."""
    if path.exists() and regular_file_size(path) is None:  # a FIFO's read would block
        return StoreProblem(None, f"{who} file {path.name}: not a regular file")
    try:
        sha = sha256_hex(path.read_bytes())
    except FileNotFoundError:
        return StoreProblem(None, f"{who} file missing: {path}")
    except OSError as exc:
        return StoreProblem(None, f"{who} file {path.name}: unreadable ({exc.strerror or exc})")
    if not path.name.endswith(f"-{sha[:16]}.safetensors"):
        return StoreProblem(None, f"{who} file {path.name}: checksum mismatch")
    try:
        # The header only (no array is read, nothing is unpickled).
        with safe_open(str(path), framework="pt") as f:
            prototypes = f.get_slice("prototypes") if "prototypes" in f.keys() else None
            shape = tuple(prototypes.get_shape()) if prototypes is not None else None
            dtype = prototypes.get_dtype() if prototypes is not None else None
    except (SafetensorError, OSError) as exc:
        return StoreProblem(None, f"{who} file {path.name}: not a readable router ({exc})")
    if not tree:
        return None
    if shape is None or len(shape) != 2 or dtype != "F32":
        return StoreProblem(
            None, f"{who} file {path.name}: no 2-D float32 prototypes array (got {shape})"
        )
    if expect is not None and shape != expect:
        return StoreProblem(
            None, f"{who} file {path.name}: {shape[0]} prototypes of dimension {shape[1]}, the "
            f"manifest has {expect[0]} experts of input_dim {expect[1]}"
        )
    return None
