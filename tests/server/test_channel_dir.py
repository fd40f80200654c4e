"""Socket folders: a server's own is private and named after it; the folders of servers that
died without cleaning up are removed by the next one, and nothing else is."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from server.pool._channel_dir import make_channel_folder, process_alive, sweep_stale_folders

DEAD, LIVING = 999_999_001, 999_999_002


def alive(pid: int) -> bool:
    return pid == LIVING


def folder_with_socket(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(folder / "a.sock"))
    return folder


def test_a_servers_folder_is_private_and_carries_its_process_id(tmp_path: Path) -> None:
    folder = make_channel_folder(tmp_path)
    assert folder.parent == tmp_path
    assert folder.name.startswith(f"momlp-channels-{os.getpid()}-")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_the_folder_of_a_dead_server_is_removed_with_its_sockets(tmp_path: Path) -> None:
    stale = folder_with_socket(tmp_path, f"momlp-channels-{DEAD}-x1")
    empty = tmp_path / f"momlp-channels-{DEAD}-x2"
    empty.mkdir()
    removed = sweep_stale_folders(tmp_path, alive=alive)
    assert sorted(removed) == sorted([stale, empty])
    assert not stale.exists() and not empty.exists()


def test_a_running_servers_folder_and_look_alikes_are_left_alone(tmp_path: Path) -> None:
    running = folder_with_socket(tmp_path, f"momlp-channels-{LIVING}-x1")
    holds_a_file = folder_with_socket(tmp_path, f"momlp-channels-{DEAD}-x2")
    (holds_a_file / "notes.txt").write_text("not a socket")
    other_name = folder_with_socket(tmp_path, "momlp-channels-x3")
    a_file = tmp_path / f"momlp-channels-{DEAD}-x4"
    a_file.write_text("a file, not a folder")
    assert sweep_stale_folders(tmp_path, alive=alive) == []
    for kept in (running, holds_a_file, other_name, a_file):
        assert kept.exists(), kept
    assert (holds_a_file / "a.sock").exists()


def test_a_missing_parent_sweeps_nothing(tmp_path: Path) -> None:
    assert sweep_stale_folders(tmp_path / "absent", alive=alive) == []


def test_process_alive_tells_this_process_from_an_unused_id() -> None:
    assert process_alive(os.getpid())
    # Linux caps process ids at 2**22; this one cannot exist.
    assert not process_alive(2**22 + 1)


def test_a_folder_whose_socket_still_accepts_connections_is_kept(tmp_path: Path) -> None:
    # Its server's process id may be invisible here (another process namespace sharing the
    # temporary directory), but an actor still listens on its socket.
    folder = tmp_path / f"momlp-channels-{DEAD}-x1"
    folder.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(folder / "a.sock"))
        listener.listen()
        assert sweep_stale_folders(tmp_path, alive=alive) == []
        assert (folder / "a.sock").exists()
    # Once nobody listens, the same folder goes.
    assert sweep_stale_folders(tmp_path, alive=alive) == [folder]
