"""`momlp serve` as a user runs it: a real process, embedded Ray, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_support import LocalModel, build_store, serve_process, wait_until

import client

pytestmark = [pytest.mark.integration, pytest.mark.ray]


def _embedded_ray_env() -> dict[str, str]:
    """This environment for a `momlp serve` that starts its own Ray (not the tests' one)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


def test_momlp_serve_answers_then_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store")
    env = _embedded_ray_env()
    args = [
        "--store",
        str(store),
        "--port",
        "0",
        "--actors",
        "1",
        "--ray-num-cpus",
        "1",
        "--no-watch-store",
    ]
    # A server killed with SIGKILL left its socket folder behind; this one removes it.
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path(tempfile.gettempdir()) / f"momlp-channels-{gone.pid}-killed"
    stale.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(stale / "a.sock"))
    with serve_process(args, env=env, cwd=tmp_path) as served:
        process, url, log = served.process, served.url, served.log
        x = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
        with client.Client(url) as sdk:
            assert sdk.ready()
            answer = sdk.predict(x.tolist(), mode="exact")
        local = LocalModel.open(store)
        nearest, _ = local.nearest(x, 1)
        expected = np.stack([local.expert(int(nearest[r, 0]), x[r : r + 1])[0] for r in range(10)])
        np.testing.assert_allclose(answer.outputs, expected, rtol=1e-5, atol=1e-6)

        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
        stopped_in = time.monotonic() - stopping
    assert returncode == 0, "".join(log)
    assert stopped_in < 30, stopped_in
    text = "".join(log)
    assert "momlp stopped" in text
    assert "Traceback" not in text
    # Each access line names its request's id, the X-Request-ID its answer carried.
    assert re.search(r'"POST /v1/predict HTTP/1.1" 200 \[request [0-9a-f]{16}\]\n', text), text
    # The startup heap (torch, Ray, the app) was taken out of the cyclic GC's full collections.
    frozen = re.search(r"froze (\d+) objects alive after startup", text)
    assert frozen is not None and int(frozen.group(1)) > 10_000, text
    # The batches reached the actor over its socket, and the socket's folder left with the server.
    own = re.search(r"actor actor-0 takes its batches over (\S+)", text)
    assert own is not None, text
    assert not Path(own.group(1)).parent.exists()
    assert not stale.exists()
    assert re.search(r"removed \d+ socket folder\(s\) of servers no longer running", text), text


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (for `momlp serve` with an embedded Ray: all of Ray's)."""
    table = subprocess.run(
        ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True
    ).stdout.split()
    children: dict[int, list[int]] = {}
    for child, parent in zip(table[::2], table[1::2], strict=True):
        children.setdefault(int(parent), []).append(int(child))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found.extend(below)
        todo.extend(below)
    return found


def test_a_server_whose_ray_cluster_dies_answers_503_at_once(tmp_path: Path) -> None:
    # Requests waited for a revival that could not come until Ray ended the server (~57 s,
    # then no answer at all), and /readyz said ready for an actor that had not been called.
    store = build_store(tmp_path / "store")
    env = _embedded_ray_env()
    args = ["--store", str(store), "--port", "0", "--actors", "2", "--ray-num-cpus", "2",
            "--no-watch-store"]
    x = [[0.1, 0.2, 0.3]]
    with serve_process(args, env=env, cwd=tmp_path) as served:
        with httpx.Client(base_url=served.url, timeout=30) as http:
            assert http.post("/v1/predict", json={"inputs": x}).status_code == 200
            ray_processes = _descendants(served.process.pid)
            assert ray_processes, "".join(served.log)
            for pid in ray_processes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            wait_until(lambda: http.get("/readyz").status_code == 503, 20, "/readyz is 503")
            answer = http.post("/v1/predict", json={"inputs": x})
        served.process.send_signal(signal.SIGTERM)
        returncode = served.process.wait(timeout=60)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "actor_failed"
    assert "the Ray cluster does not answer (its GCS at 127.0.0.1:" in error["message"]
    text = "".join(served.log)
    assert "the Ray cluster does not answer" in text and "every actor counts as dead" in text
    assert returncode == 0, text


@pytest.mark.parametrize("second_signal", [False, True])
def test_a_drain_window_keeps_serving_with_readyz_503_after_sigterm(
    tmp_path: Path, second_signal: bool
) -> None:
    store = build_store(tmp_path / "store")
    env = _embedded_ray_env()
    # The window is long where a second signal has to end it, short where it runs out.
    drain_s = "300" if second_signal else "4"
    args = ["--store", str(store), "--port", "0", "--actors", "1", "--ray-num-cpus", "1",
            "--no-watch-store", "--drain-s", drain_s]
    x = [[0.1, 0.2, 0.3]]
    with serve_process(args, env=env, cwd=tmp_path) as served:
        process = served.process
        with httpx.Client(base_url=served.url, timeout=30) as http:
            assert http.get("/readyz").status_code == 200
            process.send_signal(signal.SIGTERM)
            wait_until(lambda: http.get("/readyz").status_code == 503, 10, "/readyz is 503")
            assert "draining" in http.get("/readyz").json()["error"]["message"]
            assert http.post("/v1/predict", json={"inputs": x}).status_code == 200
            assert process.poll() is None
        if second_signal:
            process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
    text = "".join(served.log)
    assert returncode == 0, text
    assert f"requests are still served for {drain_s} s, then momlp stops" in text
    assert "momlp stopped" in text and "Traceback" not in text
