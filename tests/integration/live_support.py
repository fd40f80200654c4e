"""Helpers of the integration tests: a small real store and its local (reference) reading."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experts_store import ExpertArch, ExpertMLP, StoreWriter, load_expert

K, N, WIDTH, OUT = 8, 3, 24, 2


def build_store(root: Path, *, seed: int = 0) -> Path:
    """K random PReLU experts N -> WIDTH -> WIDTH -> OUT over K random prototypes."""
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(seed)
    arch = ExpertArch(widths=(N, WIDTH, WIDTH, OUT))
    with StoreWriter(root) as writer:
        for expert_id in range(K):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        protos = torch.randn(K, N, generator=generator)
        PrototypeTree.build(protos, branching=2, seed=seed).save(writer.router_path)
        writer.publish(task="regression", input_dim=N, output_dim=OUT, routing="tree", branching=2)
    return root


@dataclass
class LocalModel:
    """The store read straight from its files: the reference the server must agree with."""

    root: Path
    manifest: dict[str, Any]
    prototypes: np.ndarray

    @classmethod
    def open(cls, root: Path) -> LocalModel:
        from safetensors.numpy import load_file

        manifest = json.loads((root / "manifest.json").read_text())
        arrays = load_file(str(root / manifest["router_file"]))
        return cls(root, manifest, np.asarray(arrays["prototypes"], dtype=np.float64))

    def expert(self, expert_id: int, x: np.ndarray) -> np.ndarray:
        module = load_expert(self.root / self.manifest["experts"][expert_id]["file"])
        with torch.no_grad():
            out: np.ndarray = module(torch.as_tensor(x, dtype=torch.float32)).numpy()
        return out

    def nearest(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        d2 = ((x[:, None, :].astype(np.float64) - self.prototypes[None]) ** 2).sum(-1)
        order = np.argsort(d2, axis=1, kind="stable")[:, :k]
        return order, np.take_along_axis(d2, order, axis=1)


@dataclass
class LiveServer:
    url: str
    store: Path
    local: LocalModel


@contextlib.contextmanager
def serve_app(app: Any, *, name: str = "momlp-uvicorn") -> Iterator[str]:
    """uvicorn on 127.0.0.1 (free port) in a daemon thread; yields the base URL."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on")
    )
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 120.0, "server start")
    if not server.started:
        raise RuntimeError("the server failed to start (see the log)")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.02)


class GatedPool:
    """Delegates to a real pool; `run` waits for `open_gate()`, and the order of answers and
    closing is recorded, so a test can hold a request in flight across a shutdown."""

    def __init__(self, inner: Any) -> None:
        import asyncio
        import threading

        self.inner = inner
        self.entered = threading.Event()
        self.events: list[str] = []
        self._gate = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def open_gate(self) -> None:
        """Thread-safe: let the held `run` calls go on."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._gate.set)

    async def run(self, groups: Any, *, wanted: Any = None) -> Any:
        import asyncio

        self._loop = asyncio.get_running_loop()
        self.entered.set()
        await self._gate.wait()
        results = await self.inner.run(groups, wanted=wanted)
        self.events.append("answered")
        return results

    @property
    def budget_bytes(self) -> int:
        budget: int = self.inner.budget_bytes
        return budget

    @property
    def device(self) -> str:
        device: str = self.inner.device
        return device

    async def prefetch(self, experts: Any) -> None:
        await self.inner.prefetch(experts)

    async def forget_popularity(self) -> None:
        await self.inner.forget_popularity()

    def residency(self) -> Any:
        return self.inner.residency()

    def actors(self) -> Any:
        return self.inner.actors()

    async def close(self) -> None:
        self.events.append("closed")
        await self.inner.close()


_SERVING_URL = re.compile(r"momlp serving .* at (http://127\.0\.0\.1:\d+)")


def momlp_command() -> list[str]:
    """The `momlp` console script of this environment (or the module, if not installed)."""
    script = Path(sys.executable).parent / "momlp"
    return [str(script)] if script.exists() else [sys.executable, "-m", "server._cli"]


@dataclass
class ServeProcess:
    """A `momlp serve` child process, its URL once ready, and everything it logged."""

    process: subprocess.Popen[str]
    url: str
    log: list[str]


@contextlib.contextmanager
def serve_process(
    args: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    ready_timeout: float = 120.0,
    until: re.Pattern[str] = _SERVING_URL,
) -> Iterator[ServeProcess]:
    """Start `momlp serve ARGS`, wait for the line that logs its URL (or matches `until`,
    whose first group, if any, is taken as the URL), and always stop it.

    stderr is pumped by a thread (the server logs a lot; a full pipe would block it). On
    exit a process still running gets SIGTERM, then SIGKILL after a minute.
    """
    process = subprocess.Popen(
        [*momlp_command(), "serve", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
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
        deadline = time.monotonic() + ready_timeout
        while url is None and time.monotonic() < deadline and process.poll() is None:
            try:
                match = until.search(lines.get(timeout=1.0))
            except queue.Empty:
                continue
            url = (match.group(1) if until.groups else "") if match else None
        assert url is not None, "".join(log)
        yield ServeProcess(process, url, log)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        pumping.join(timeout=10)
        if process.stderr is not None:
            process.stderr.close()
