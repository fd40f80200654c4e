"""Helpers shared by the app tests: settings over a store, the fake pool, a running app."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from fastapi import FastAPI

from experts_store import ExpertArch, ExpertMLP, ExpertRef, StoreWriter, load_expert
from server import Settings, create_app
from server.pool import ActorInfo, ExpertPool, FakeExpertPool, Group, GroupResult


def app_settings(store: Path, **overrides: Any) -> Settings:
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
    return create_app(app_settings(store, **overrides), pool_factory=fake_pool)


class ExplodingBatcher:
    """A batcher whose every submit raises an error the app does not expect."""

    queued_rows = 0

    async def submit(self, x: Any, options: Any = None) -> Any:
        raise RuntimeError("secret internals")

    async def close(self) -> None:
        return None


def exploding_app(store: Path) -> FastAPI:
    """An app whose predict raises `RuntimeError("secret internals")` inside the batcher."""
    return create_app(
        app_settings(store),
        pool_factory=fake_pool,
        batcher_factory=lambda *args: ExplodingBatcher(),
    )


@asynccontextmanager
async def running(app: FastAPI, **client_kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan started, and an httpx client talking to it in-process."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://momlp.test", **client_kwargs
        ) as client:
            yield client


def build_small_store(
    root: Path, *, K: int = 8, n: int = 4, width: int = 16, out: int = 2, seed: int = 0
) -> Path:
    """A published store of K random PReLU experts n -> width -> out over K random prototypes.

    Publishing again into the same root with another seed gives a new store version with
    other experts of the same shapes (what the reload tests swap to).
    """
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(seed)
    arch = ExpertArch(widths=(n, width, out))
    with StoreWriter(root) as writer:
        for expert_id in range(K):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        protos = torch.randn(K, n, generator=generator)
        PrototypeTree.build(protos, branching=4, seed=0).save(writer.router_path)
        writer.publish(task="regression", input_dim=n, output_dim=out, routing="tree", branching=4)
    return root


def manifest(store: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((store / "manifest.json").read_text())
    return data


def expert_outputs(store: Path, expert_id: int, x: np.ndarray) -> np.ndarray:
    """Forward of one expert read straight from its file (independent of the server)."""
    module = load_expert(store / manifest(store)["experts"][expert_id]["file"])
    with torch.no_grad():
        out: np.ndarray = module(torch.as_tensor(x, dtype=torch.float32)).numpy()
    return out


def prototypes(store: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    arrays = load_file(str(store / manifest(store)["router_file"]))
    return np.asarray(arrays["prototypes"], dtype=np.float64)


def nearest_k(store: Path, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force float64 k nearest prototypes: (indices [B, k], squared distances [B, k])."""
    protos = prototypes(store)
    d2 = ((x[:, None, :].astype(np.float64) - protos[None, :, :]) ** 2).sum(-1)
    order = np.argsort(d2, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(d2, order, axis=1)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The `error` object of an error response, checking the one error shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"code", "message", "detail"}, error
    assert isinstance(error["code"], str) and isinstance(error["message"], str)
    assert "Traceback" not in response.text
    return error


class BlockingPool:
    """Delegates to a real pool, but the first `blocked` runs wait until the test opens the
    gate (all of them when `blocked` is None)."""

    def __init__(self, inner: ExpertPool, *, blocked: int | None = None) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self._blocked = blocked

    @property
    def budget_bytes(self) -> int:
        return self.inner.budget_bytes

    @property
    def device(self) -> str:
        return self.inner.device

    async def run(
        self, groups: list[Group], *, wanted: Callable[[], bool] | None = None
    ) -> list[GroupResult]:
        if self._blocked is None or self._blocked > 0:
            if self._blocked is not None:
                self._blocked -= 1
            self.entered.set()
            await self.gate.wait()
        return await self.inner.run(groups, wanted=wanted)

    async def prefetch(self, experts: Sequence[ExpertRef]) -> None:
        await self.inner.prefetch(experts)

    async def forget_popularity(self) -> None:
        await self.inner.forget_popularity()

    def residency(self) -> dict[str, list[str]]:
        return self.inner.residency()

    def actors(self) -> list[ActorInfo]:
        return self.inner.actors()

    async def close(self) -> None:
        self.gate.set()
        await self.inner.close()


def republish(root: Path, seed: int) -> str:
    """Publish other experts (same shapes) into the store at ``root``; the new store version."""
    build_small_store(root, seed=seed)
    version: str = manifest(root)["store_version"]
    return version
