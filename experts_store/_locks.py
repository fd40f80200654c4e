"""The file locks of a store's writers (POSIX `flock`).

Each writer holds one on a file in its staging folder for as long as it lives, so a publish
tells a writer still at work (its folder is left alone, however long training takes) from
one that died (its folder goes). A publish holds the store's own lock while it moves files
and replaces the manifest, so that two publishes are one after the other, and one that
depends on the version it started from can check it is still the live one.

The kernel drops a process's locks when it ends, however it ends: a SIGKILLed build leaves
its folder unlocked.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["FileLock", "held_elsewhere"]


class FileLock:
    """An exclusive lock on `path` (created if need be), held until `release()`."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def take(
        cls,
        path: Path,
        *,
        wait_s: float = 0.0,
        poll_s: float = 0.05,
        sleep: Callable[[float], None] = time.sleep,
    ) -> FileLock | None:
        """The lock, waiting up to `wait_s` for its holder to let go; None if it did not."""
        # Read-only, and created as the umask allows like every other store file: `flock`
        # needs no write access, so a store a group shares takes any member's publish.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
        waited = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waited >= wait_s:
                    os.close(fd)
                    return None
                sleep(poll_s)
                waited += poll_s
                continue
            return cls(fd, path)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the lock
            self._fd = None


def held_elsewhere(path: Path) -> bool | None:
    """Whether another open file holds the lock on `path` (in this process or another):
    None when `path` does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
