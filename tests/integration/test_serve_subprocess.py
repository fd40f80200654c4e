"""`momlp serve` as a user runs it: a real process, embedded Ray, stopped with SIGTERM."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from live_support import LocalModel, build_store

import client

pytestmark = [pytest.mark.integration, pytest.mark.ray]

_URL = re.compile(r"momlp serving .* at (http://127\.0\.0\.1:\d+)")


def _momlp() -> list[str]:
    script = Path(sys.executable).parent / "momlp"
    return [str(script)] if script.exists() else [sys.executable, "-m", "server._cli"]


def test_momlp_serve_answers_then_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(
        [
            *_momlp(),
            "serve",
            "--store",
            str(store),
            "--port",
            "0",
            "--actors",
            "1",
            "--ray-num-cpus",
            "1",
            "--no-watch-store",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def pump() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line)
            lines.put(line)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline and process.poll() is None:
            try:
                match = _URL.search(lines.get(timeout=1.0))
            except queue.Empty:
                continue
            url = match.group(1) if match else None
        assert url is not None, "".join(log)

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
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        pumping.join(timeout=10)
        assert process.stderr is not None
        process.stderr.close()
    assert returncode == 0, "".join(log)
    assert stopped_in < 30, stopped_in
    text = "".join(log)
    assert "momlp stopped" in text
    assert "Traceback" not in text
