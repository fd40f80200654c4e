"""The private folder that holds a server's actor sockets, and the sweep of dead servers' ones.

A server removes its folder when it stops, but one killed with SIGKILL (or by the OOM killer)
cannot: its folder and sockets stay in the temporary directory. Each folder's name carries the
server's process id, so the next server on the machine removes those whose process is gone.
It removes a folder only if the current user owns it, it holds nothing but sockets, and none
of them accepts a connection: a folder that merely looks like one is left alone, a reused
process id only delays a sweep, and a live server whose process id this one cannot see (a
temporary directory shared across process namespaces) keeps its folder, since its actors
still listen there.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["PREFIX", "make_channel_folder", "process_alive", "sweep_stale_folders"]

logger = logging.getLogger(__name__)

PREFIX = "momlp-channels-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[A-Za-z0-9_]+")


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def make_channel_folder(parent: Path | None = None) -> Path:
    """A new folder only this user can enter, named after this process (OSError if none)."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))


def sweep_stale_folders(
    parent: Path | None = None, *, alive: Callable[[int], bool] = process_alive
) -> list[Path]:
    """Remove the socket folders of servers that are no longer running; returns them."""
    root = Path(parent if parent is not None else tempfile.gettempdir())
    removed: list[Path] = []
    try:
        candidates = list(root.iterdir())
    except OSError:
        return removed
    uid = os.getuid()
    for folder in candidates:
        match = _NAME.fullmatch(folder.name)
        if match is None or alive(int(match.group(1))):
            continue
        try:
            if _remove_socket_folder(folder, uid):
                removed.append(folder)
        except OSError as exc:  # another server swept it first, or it changed under us
            logger.debug("left %s: %s", folder, exc)
    if removed:
        logger.info("removed %s socket folder(s) of servers no longer running", len(removed))
    return removed


def _remove_socket_folder(folder: Path, uid: int) -> bool:
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        return False
    entries = list(folder.iterdir())
    if any(not stat.S_ISSOCK(entry.lstat().st_mode) for entry in entries):
        return False
    if any(_listening(entry) for entry in entries):
        return False
    for entry in entries:
        entry.unlink()
    folder.rmdir()
    return True


def _listening(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket at `path` (an actor's
    channel server sees the connection close at once and ends that thread)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):  # nobody serves there
            return False
        except OSError:  # no answer in time (a full backlog?): assume it is alive
            return True
    return True
