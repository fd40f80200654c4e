"""Helpers of the reliability suite: small stores, the app over the in-process pool, a real
uvicorn on a loopback port, and the server process's resident memory."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from fastapi import FastAPI

from experts_store import ExpertArch, ExpertMLP, StoreWriter, load_expert
from server import Settings, create_app
from server.pool import ExpertPool, FakeExpertPool

K, N, WIDTH, OUT = 8, 4, 16, 2


def publish_store(root: Path, *, seed: int = 0, K: int = K, width: int = WIDTH) -> str:
    """Publish K random PReLU experts N -> width -> OUT into `root`; the new store_version."""
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(seed)
    arch = ExpertArch(widths=(N, width, OUT))
    with StoreWriter(root) as writer:
        for expert_id in range(K):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        protos = torch.randn(K, N, generator=generator)
        PrototypeTree.build(protos, branching=4, seed=seed).save(writer.router_path)
        manifest = writer.publish(
            task="regression", input_dim=N, output_dim=OUT, routing="tree", branching=4
        )
    return manifest.store_version


def manifest_of(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / "manifest.json").read_text())
    return data


class Reference:
    """One store version read straight from its files: what the server must answer."""

    def __init__(self, root: Path) -> None:
        from safetensors.numpy import load_file

        self.manifest = manifest_of(root)
        self.version: str = self.manifest["store_version"]
        self.prototypes = np.asarray(
            load_file(str(root / self.manifest["router_file"]))["prototypes"], dtype=np.float64
        )
        self._modules = {e["id"]: load_expert(root / e["file"]) for e in self.manifest["experts"]}

    def nearest(self, x: np.ndarray) -> np.ndarray:
        d2 = ((x[:, None, :].astype(np.float64) - self.prototypes[None]) ** 2).sum(-1)
        return np.argmin(d2, axis=1)

    def outputs(self, experts: np.ndarray, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return np.stack(
                [
                    self._modules[int(e)](
                        torch.as_tensor(x[i : i + 1], dtype=torch.float32)
                    ).numpy()[0]
                    for i, e in enumerate(experts)
                ]
            )


def settings_for(store: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "store": store,
        "watch_store": False,
        "actors": 2,
        "cache_bytes": 1 << 20,
        "max_batch_wait_ms": 0.0,
    }
    values.update(overrides)
    return Settings(**values)


def fake_pool(settings: Settings) -> ExpertPool:
    return FakeExpertPool(settings)


def fake_app(store: Path, **overrides: Any) -> FastAPI:
    return create_app(settings_for(store, **overrides), pool_factory=fake_pool)


@asynccontextmanager
async def running(app: FastAPI, **client_kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan started and an in-process httpx client."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(
            app=app, client=client_kwargs.pop("client", ("127.0.0.1", 50000))
        )
        async with httpx.AsyncClient(
            transport=transport, base_url="http://momlp.test", **client_kwargs
        ) as client:
            yield client


@contextmanager
def serve_in_thread(app: FastAPI, *, timeout_s: float = 120.0) -> Iterator[str]:
    """uvicorn on 127.0.0.1 (free port) in a daemon thread; yields the base URL."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="momlp-reliability-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and thread.is_alive():
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not start")
        time.sleep(0.02)
    if not server.started:
        raise RuntimeError("the server failed to start (see the log)")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def rss_bytes() -> int:
    """This process's resident set size, from /proc (psutil is not a dependency)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def raw_request(url: str, data: bytes, *, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """Send raw bytes to the server; (status, whole response). Reads until the server closes
    or one response is complete (Content-Length known)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while length is not None and len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, body


def error_code(response: httpx.Response) -> str:
    """The error code of a JSON error response, checking the one error shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert "Traceback" not in response.text
    code: str = body["error"]["code"]
    return code
