"""What the app's lifespan owns: the serving generation(s) and the store watcher.

A `Generation` is one published store version with its router, expert pool and batcher.
`ServingState` holds the current one; a request enters it with `use()` and keeps it until it
has answered, so a hot reload that swaps generations never pulls a pool from under a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch

from experts_store import Clock, Manifest, Store
from router import PrototypeTree
from server._exceptions import NotReady
from server._metrics import Metrics, PoolSnapshot
from server._runtime_types import ActorInfo, BatchAnswer, ExpertPool, Group, GroupResult
from server._settings import Settings

__all__ = [
    "BatcherFactory",
    "EvictionCounter",
    "BatcherLike",
    "Generation",
    "ObservedPool",
    "PoolFactory",
    "ServingState",
]

logger = logging.getLogger(__name__)

Mode = Literal["tree", "exact"]


class BatcherLike(Protocol):
    """What the app needs of `server._batcher.Batcher`."""

    async def submit(self, x: torch.Tensor, *, top_k: int, mode: Mode) -> BatchAnswer: ...
    async def close(self) -> None: ...


PoolFactory = Callable[[Settings, Store], "Awaitable[ExpertPool] | ExpertPool"]
BatcherFactory = Callable[[PrototypeTree, ExpertPool, Settings, Clock, Metrics], BatcherLike]


@dataclass
class Generation:
    store: Store
    manifest: Manifest
    router: PrototypeTree
    pool: ExpertPool
    batcher: BatcherLike
    in_flight: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def version(self) -> str:
        return self.manifest.store_version

    @property
    def default_mode(self) -> Mode:
        return self.manifest.routing

    async def close(self) -> None:
        try:
            await self.batcher.close()
        finally:
            await self.pool.close()


def _default_batcher(
    router: PrototypeTree, pool: ExpertPool, settings: Settings, clock: Clock, metrics: Metrics
) -> BatcherLike:
    from server._batcher import Batcher

    return Batcher(router, pool, settings, clock)


class ObservedPool:
    """The pool as the batcher sees it: each `run` call is one batch, and its rows are counted."""

    def __init__(self, pool: ExpertPool, on_batch: Callable[[int], None]) -> None:
        self._pool = pool
        self._on_batch = on_batch

    async def run(self, groups: list[Group]) -> list[GroupResult]:
        self._on_batch(sum(int(group.rows.shape[0]) for group in groups))
        return await self._pool.run(groups)

    async def prefetch(self, expert_ids: list[int]) -> None:
        await self._pool.prefetch(expert_ids)

    def residency(self) -> dict[int, list[str]]:
        return self._pool.residency()

    def actors(self) -> list[ActorInfo]:
        return self._pool.actors()

    async def close(self) -> None:
        await self._pool.close()


async def _default_pool(settings: Settings, store: Store) -> ExpertPool:
    from server._ray_pool import RayExpertPool

    # create() blocks until every actor has opened the store.
    pool: ExpertPool = await asyncio.to_thread(RayExpertPool.create, store.root, settings)
    return pool


class EvictionCounter:
    """Counts experts that left an actor's cache between two looks at the pool's residency.

    The pool reports residency, not eviction counts; an expert loaded and evicted between
    two looks is missed, so this is a lower bound (looked at after every prediction).
    """

    def __init__(self) -> None:
        self.total = 0
        self._seen: dict[str, set[int]] = {}

    def observe(self, residency: dict[int, list[str]]) -> None:
        now: dict[str, set[int]] = {}
        for expert_id, actors in residency.items():
            for actor in actors:
                now.setdefault(actor, set()).add(expert_id)
        for actor, before in self._seen.items():
            self.total += len(before - now.get(actor, set()))
        self._seen = now

    def forget(self) -> None:
        """Start afresh (a new generation's pool): its empty caches are not evictions."""
        self._seen = {}


def _store_version(root: Path) -> str | None:
    """The published store_version, read without opening the whole store (None if absent)."""
    try:
        with open(root / "manifest.json", encoding="utf-8") as fh:
            version = json.load(fh).get("store_version")
    except (OSError, ValueError, AttributeError):
        return None
    return str(version) if version is not None else None


class ServingState:
    """The resources of one app, built by `start()` and released by `stop()`."""

    def __init__(
        self,
        *,
        settings: Settings,
        metrics: Metrics,
        clock: Clock,
        pool_factory: PoolFactory | None,
        batcher_factory: BatcherFactory | None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.pool_factory: PoolFactory = pool_factory or _default_pool
        self.batcher_factory: BatcherFactory = batcher_factory or _default_batcher
        self.generation: Generation | None = None
        self.stopping = False
        self._started_ray = False
        self._watcher: asyncio.Task[None] | None = None
        self._swap_lock = asyncio.Lock()
        self.evictions = EvictionCounter()
        # Replaceable so that tests drive the store watcher without waiting.
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    async def start(self) -> None:
        self.stopping = False
        if self.pool_factory is _default_pool:
            from server._runner import ensure_ray

            # On the loop's thread (the main one under uvicorn): ray.init may install signal
            # handlers. Blocking here is fine, nothing is served before startup ends.
            self._started_ray = ensure_ray(self.settings)
        self.generation = await self.build_generation()
        logger.info(
            "serving store %s version %s (%d experts)",
            self.settings.store,
            self.generation.version,
            self.generation.manifest.num_experts,
        )
        if self.settings.watch_store:
            self._watcher = asyncio.create_task(self._watch(), name="momlp-store-watcher")

    async def stop(self) -> None:
        self.stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        gen, self.generation = self.generation, None
        try:
            if gen is not None:
                await gen.close()
        finally:
            if self._started_ray:
                from server._runner import shutdown_ray

                await asyncio.to_thread(shutdown_ray)

    async def build_generation(self) -> Generation:
        settings = self.settings
        store = await asyncio.to_thread(Store.open, settings.store)
        router = await asyncio.to_thread(PrototypeTree.load, store.router_path)
        made = self.pool_factory(settings, store)
        pool: ExpertPool = await made if inspect.isawaitable(made) else made
        try:
            observed = ObservedPool(pool, self.metrics.observe_batch)
            batcher = self.batcher_factory(router, observed, settings, self.clock, self.metrics)
        except BaseException:
            await pool.close()
            raise
        return Generation(store, store.manifest, router, pool, batcher)

    def current(self) -> Generation:
        gen = self.generation
        if gen is None or self.stopping:
            raise NotReady(reason="the store and the pool are not up")
        return gen

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[Generation]:
        """The current generation, kept open until the caller is done with it."""
        gen = self.current()
        gen.in_flight += 1
        gen.drained.clear()
        try:
            yield gen
        finally:
            gen.in_flight -= 1
            if gen.in_flight == 0:
                gen.drained.set()

    def after_prediction(self, gen: Generation) -> None:
        if gen is self.generation:
            self.evictions.observe(gen.pool.residency())

    def pool_snapshot(self) -> PoolSnapshot | None:
        gen = self.generation
        if gen is None:
            return None
        actors = gen.pool.actors()
        self.evictions.observe(gen.pool.residency())
        queued = getattr(gen.batcher, "queued_rows", 0)
        return PoolSnapshot(
            resident_bytes={a.name: a.resident_bytes for a in actors},
            evictions=self.evictions.total,
            queue_rows=int(queued() if callable(queued) else queued),
        )

    async def reload(self) -> bool:
        """Build a generation from the store on disk and swap it in if its version is new."""
        async with self._swap_lock:
            old = self.generation
            if old is None or self.stopping:
                return False
            new = await self.build_generation()
            if new.version == old.version:
                await new.close()
                return False
            self.generation = new
            self.evictions.forget()
            logger.info("store version %s replaces %s", new.version, old.version)
        await self._retire(old)
        return True

    async def _retire(self, old: Generation) -> None:
        # Requests that entered the old generation finish on it; then its pool is released.
        if old.in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(old.drained.wait(), self.settings.request_timeout_s)
        await old.close()

    async def _watch(self) -> None:
        interval = self.settings.watch_interval_s
        while True:
            await self.sleep(interval)
            gen = self.generation
            if gen is None:
                continue
            version = await asyncio.to_thread(_store_version, Path(self.settings.store))
            if version is None or version == gen.version:
                continue
            try:
                await self.reload()
            except Exception as exc:
                # A half-written or broken new store must not take the serving one down.
                logger.error("reloading store version %s failed: %s", version, exc)
