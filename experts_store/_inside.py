"""Files a store reads lie inside its directory once every symbolic link is followed.

A server (and each of its Ray actors) reads a store with its own rights: a manifest.json,
router or expert file that is a link to somewhere else (`/etc/...`, another tenant's
volume) is refused, naming the file. Links that stay inside the store are followed as
before (a store on a shared volume may link its files to one another), and so is a store
directory that is itself a link (`/srv/store -> /mnt/volume/store-v2`): what is compared is
the file's real path with the real path of the directory. Hard links are no links here:
they are the file (`StoreWriter.link_expert_file` makes them).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["opened_outside", "resolves_outside"]


def resolves_outside(path: Path | str, root: Path | str) -> str | None:
    """The real path of `path` when it is not inside the real path of `root`; None when it
    is (a path that does not exist is judged by the links that do: the read that follows
    reports it missing)."""
    return _outside(os.path.realpath(path), root)


def opened_outside(fd: int, path: Path | str, root: Path | str) -> str | None:
    """`resolves_outside` for the file open as `fd` (opened from `path`): the file read is
    the one judged, whatever the path names by the time it is judged.

    One readlink of the descriptor where /proc has it (Linux); a path in which no link was
    followed and which starts with `root` needs nothing more (every load of an expert asks).
    """
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc (not Linux): the path's links as they are now
        real = os.path.realpath(path)
    named, base = os.fspath(path), os.fspath(root)
    if real == named and named.startswith(base.rstrip(os.sep) + os.sep):
        return None
    # A store directory that is a link: its real path as last resolved, trusted while the
    # root still leads to that same directory (one stat, ~1 µs, where a realpath is ~20 µs);
    # else the root is resolved again (the link may have been pointed elsewhere).
    known = _real_roots.get(base)
    if known is not None and _within(real, known[0]) and _identity(base) == known[1]:
        return None
    return _outside(real, root)


# A root as named -> (its real path when last resolved, that directory's (device, inode)):
# a few stores per process; a dict's get and set are atomic under the GIL, so threads share
# it without a lock.
_real_roots: dict[str, tuple[str, tuple[int, int] | None]] = {}


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _outside(real: str, root: Path | str) -> str | None:
    base = os.path.realpath(root)
    identity = _identity(base)  # of the directory resolved, not of what the root names later
    if identity is not None:
        _real_roots[os.fspath(root)] = (base, identity)
    return None if _within(real, base) else real


def _within(real: str, base: str) -> bool:
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)
