"""What a writer reads of the store it publishes into: the live manifest, read with the
checks `Store.open` makes (a regular file inside the store, at most MAX_MANIFEST_BYTES,
valid when read strictly), the version it names and the files it references."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from experts_store._exceptions import ManifestError, StoreError, StoreNotFound
from experts_store._inside import opened_outside
from experts_store._manifest import MAX_MANIFEST_BYTES, read_manifest
from experts_store._paced_json import decode_json_member

__all__ = ["MANIFEST_NAME", "live_manifest", "live_version", "read_manifest_file"]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
# The store_version is the manifest's second member: its start settles it.
_VERSION_WITHIN = 1 << 16


def read_manifest_file(root: Path, *, limit: int | None = None) -> bytes:
    """manifest.json's bytes (at most its first `limit`): StoreNotFound when there is none,
    ManifestError when it is not a regular file, a link leads out of `root`, or it is larger
    than MAX_MANIFEST_BYTES (refused from its size, unread)."""
    path = root / MANIFEST_NAME
    try:
        # Not blocking: a FIFO there would block the read for good. The checks below are of
        # the file opened, not of what the path names by then.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise StoreNotFound(root=root) from exc
    except OSError as exc:  # unreadable
        raise ManifestError(root=root, message=f"cannot read {path.name}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO
            raise ManifestError(root=root, message=f"cannot read {path.name}: not a regular file")
        outside = opened_outside(fd, path, root)
        if outside is not None:
            # Not where it leads: a reload's 503 reason shows this text to its caller.
            raise ManifestError(
                root=root, message=f"{path.name} is a link that leads outside the store"
            )
        if st.st_size > MAX_MANIFEST_BYTES:
            # Decoding it would take several times that in memory.
            raise ManifestError(
                root=root,
                message=f"{path.name} holds {st.st_size} bytes, more than the "
                f"{MAX_MANIFEST_BYTES} a manifest may (MAX_MANIFEST_BYTES)",
            )
        # Its size as opened: a publish replaces the file, it never writes into it.
        size = st.st_size if limit is None else min(limit, st.st_size)
        with open(fd, "rb", closefd=False) as fh:
            return fh.read(size)
    except OSError as exc:
        raise ManifestError(root=root, message=f"cannot read {path.name}: {exc}") from exc
    finally:
        os.close(fd)


def live_manifest(root: Path) -> tuple[str | None, set[str] | None]:
    """The live version and the files its manifest references: (None, set()) for no store,
    (None, None) for a manifest `Store.open` would refuse, which a publish replaces: which
    files it references is unknown, so that publish deletes none (logged as a warning)."""
    try:
        manifest = read_manifest(read_manifest_file(root), root=root)
    except StoreNotFound:
        return None, set()
    except ManifestError as exc:
        logger.warning(
            "%s: this publish replaces it and keeps every file (which it referenced is unknown)",
            exc,
        )
        return None, None
    return manifest.store_version, manifest.referenced_files


def live_version(root: Path) -> str | None:
    """The live store_version, read from the manifest's start (None: no readable store)."""
    try:
        raw = read_manifest_file(root, limit=_VERSION_WITHIN)
        try:
            version = decode_json_member(raw, "store_version")
        except ValueError:  # the start did not settle it: a manifest past 64 KiB
            version = decode_json_member(read_manifest_file(root), "store_version")
    except (StoreError, ValueError, KeyError):
        return None
    return version if isinstance(version, str) else None
