"""A writer's staging folder: its name, the lock its writer holds in it, the store's publish
lock, and how a folder left by a writer that is gone is told from one still at work
(`experts_store._locks`)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from experts_store._exceptions import StoreError
from experts_store._locks import FileLock, held_elsewhere

__all__ = [
    "PUBLISH_LOCK_NAME",
    "STAGING_PREFIX",
    "WRITER_LOCK_NAME",
    "abandoned",
    "new_version",
    "publish_lock",
]

STAGING_PREFIX = ".staging-"
# Held by each writer in its staging folder for its whole life, and by a publish in the root.
WRITER_LOCK_NAME = ".writer.lock"
PUBLISH_LOCK_NAME = ".publish.lock"
# A writer locks its lock file right after creating it: one unlocked for longer than this
# belongs to a writer that is gone (killed, or its machine rebooted).
_UNLOCKED_GRACE_S = 10.0
# A publish takes well under a second; one holding the lock this long is stuck.
_PUBLISH_WAIT_S = 120.0


def new_version(now: datetime) -> str:
    """A store version (and its staging folder's name) for a publish at `now`."""
    # Sortable by time; the random suffix keeps two publishes in one microsecond apart.
    return now.strftime("%Y%m%dT%H%M%S%fZ") + "-" + secrets.token_hex(3)


@contextlib.contextmanager
def publish_lock(root: Path) -> Iterator[None]:
    """The store's publish lock, waited for while another publish holds it."""
    lock = FileLock.take(root / PUBLISH_LOCK_NAME, wait_s=_PUBLISH_WAIT_S)
    if lock is None:
        raise StoreError(
            f"another publish into {root} has held {PUBLISH_LOCK_NAME} for "
            f"{_PUBLISH_WAIT_S:g} s; nothing was published"
        )
    try:
        yield
    finally:
        lock.release()


def abandoned(staging: Path, now: float, stale_staging_seconds: float) -> bool:
    """True for the staging folder of a writer that is gone: its lock is free (and has
    been past the moment a writer takes it), or, for a folder without one, it is older
    than `stale_staging_seconds`. A locked one is at work, however old."""
    lock = staging / WRITER_LOCK_NAME
    held = held_elsewhere(lock)
    if held:
        return False
    try:
        since = (staging if held is None else lock).stat().st_mtime
    except FileNotFoundError:
        return False
    limit = stale_staging_seconds if held is None else _UNLOCKED_GRACE_S
    return now - since > limit
