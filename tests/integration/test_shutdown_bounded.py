"""SIGTERM stops `momlp serve` within request_timeout_s + 5 s whatever is in flight, exits 0,
and leaves none of the processes it started (Ray's included) behind.

Each case runs a real `momlp serve` whose two actors take both CPUs of its embedded Ray.
"Stuck" is made with a FIFO in place of a file: opening it blocks until someone writes, as a
read on a hung network mount does.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_support import LocalModel, build_store, serve_process

pytestmark = [pytest.mark.integration, pytest.mark.ray]

REQUEST_TIMEOUT_S = 4.0
BOUND_S = REQUEST_TIMEOUT_S + 5.0


def _children() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        table.setdefault(ppid, []).append(int(entry.name))
    return table


def descendants(pid: int) -> set[int]:
    table, found, todo = _children(), set(), [pid]
    while todo:
        for child in table.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[object, Path]]:
    store = build_store(tmp_path / "store")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "MOMLP_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        "MOMLP_WATCH_INTERVAL_S": "0.5",
    }
    env.pop("RAY_ADDRESS", None)
    args = ["--store", str(store), "--port", "0", "--actors", "2", "--ray-num-cpus", "2"]
    with serve_process(args, env=env, cwd=tmp_path) as process:
        yield process, store


def stop_and_check(served: object) -> None:
    process, log = served.process, served.log  # type: ignore[attr-defined]
    started = descendants(process.pid)
    assert any("ray::" in cmdline(pid) for pid in started), "no Ray worker was found"
    stopping = time.monotonic()
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=60)
    stopped_in = time.monotonic() - stopping
    text = "".join(log)
    assert returncode == 0, text
    assert stopped_in <= BOUND_S, (stopped_in, text)
    deadline = time.monotonic() + 5.0  # the kernel may take a moment to reap the last ones
    while (left := {pid for pid in started if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [cmdline(pid) for pid in left]


def post_in_background(url: str, **kwargs: object) -> threading.Thread:
    def send() -> None:
        try:
            httpx.post(url, timeout=60.0, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError:
            pass  # the server going away mid-request is what these tests do

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_sigterm_during_a_stuck_reload(served: tuple[object, Path]) -> None:
    process, store = served
    url = process.url  # type: ignore[attr-defined]
    assert httpx.post(f"{url}/v1/admin/reload", timeout=10).json()["reloaded"] is False
    manifest = store / "manifest.json"
    manifest.rename(store / "manifest.json.bak")
    os.mkfifo(manifest)  # every read of the manifest now hangs
    post_in_background(f"{url}/v1/admin/reload")
    time.sleep(1.0)  # the watcher and the admin reload are both stuck on the manifest now
    stop_and_check(process)


def test_sigterm_during_a_stuck_load(served: tuple[object, Path]) -> None:
    process, store = served
    url = process.url  # type: ignore[attr-defined]
    local = LocalModel.open(store)
    x = np.random.default_rng(0).normal(size=(200, 3))
    nearest, _ = local.nearest(x, 1)
    expert = int(nearest[0, 0])
    path = store / local.manifest["experts"][expert]["file"]
    path.unlink()
    os.mkfifo(path)  # the actor's read of this expert hangs
    post_in_background(f"{url}/v1/predict", json={"inputs": x[:1].tolist(), "mode": "exact"})
    time.sleep(1.0)
    stop_and_check(process)


def test_sigterm_right_after_an_actor_was_killed(served: tuple[object, Path]) -> None:
    process, _store = served
    url = process.url  # type: ignore[attr-defined]
    x = np.random.default_rng(1).normal(size=(64, 3))
    assert httpx.post(f"{url}/v1/predict", json={"inputs": x.tolist()}, timeout=30).is_success
    pid = process.process.pid  # type: ignore[attr-defined]
    actors = [p for p in descendants(pid) if "ExpertActor" in cmdline(p)]
    assert actors, "no actor process was found"
    os.kill(actors[0], signal.SIGKILL)
    post_in_background(f"{url}/v1/predict", json={"inputs": x.tolist()})
    stop_and_check(process)


def test_sigterm_while_the_actors_start_stops_at_once(tmp_path: Path) -> None:
    """Two actors on a one-CPU Ray: the second cannot be placed, so the server sits in its
    startup for the actors' start timeout (three minutes in tests). A SIGTERM there ends the
    start, exits 0 and leaves nothing of Ray behind; it used to wait out the timeout."""
    store = build_store(tmp_path / "store")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    args = ["--store", str(store), "--port", "0", "--actors", "2", "--ray-num-cpus", "1"]
    starting = re.compile(r"Waiting for application startup")
    with serve_process(args, env=env, cwd=tmp_path, until=starting) as served:
        deadline = time.monotonic() + 60.0  # the first actor's worker: Ray is fully up
        while not any("ray::" in cmdline(pid) for pid in descendants(served.process.pid)):
            assert time.monotonic() < deadline, "".join(served.log)
            time.sleep(0.2)
        stop_and_check(served)
    text = "".join(served.log)
    assert "a stop was asked for before the actors were up" in text
    assert "momlp stopped before it was ready" in text
    # A stop that was asked for is not reported as an error (log alerts would fire on it).
    assert not [line for line in served.log if " ERROR " in line], text
