"""The actor pool as the serving floor holds it: how the app's one pool is made, and the view
of it each store version's batcher gets.

The pool is built once, when the app starts, and outlives every store version; a version's
batcher sees it through `ObservedPool`, which counts each batch's rows for the metrics and
leaves closing the pool to the server.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Sequence

from experts_store import ExpertRef
from server._exceptions import PoolStartFailed
from server._settings import Settings
from server.pool import ActorInfo, ExpertPool, Group, GroupResult

__all__ = ["ObservedPool", "PoolFactory", "ray_pool"]

PoolFactory = Callable[[Settings], "Awaitable[ExpertPool] | ExpertPool"]


def ray_pool(stop: threading.Event | None = None) -> PoolFactory:
    """The default pool factory: Ray actors in the Ray this process runs. A set `stop` (the
    server's signal handling sets it) ends a start still waiting for its actors."""

    async def make(settings: Settings) -> ExpertPool:
        import ray

        from server.pool import RayExpertPool

        if not ray.is_initialized():
            raise PoolStartFailed(
                reason="Ray is not running (start it with server.pool.ray_session)"
            )
        # create() blocks until every actor is up (or its start timeout, or `stop`).
        pool = await asyncio.to_thread(
            functools.partial(RayExpertPool.create, settings, stop=stop)
        )
        if settings.actor_health_check_s > 0:
            pool.start_health_checks(
                settings.actor_health_check_s, settings.actor_unresponsive_s
            )
        return pool

    return make


class ObservedPool:
    """The pool as one version's batcher sees it: each `run` is one batch, its rows counted."""

    def __init__(
        self,
        pool: ExpertPool,
        on_batch: Callable[[int], None],
        on_generated: Callable[[int], None] | None = None,
    ) -> None:
        self._pool = pool
        self._on_batch = on_batch
        self._on_generated = on_generated

    @property
    def budget_bytes(self) -> int:
        return self._pool.budget_bytes

    @property
    def device(self) -> str:
        return self._pool.device

    async def run(
        self, groups: list[Group], *, wanted: Callable[[], bool] | None = None
    ) -> list[GroupResult]:
        self._on_batch(sum(int(group.rows.shape[0]) for group in groups))
        results = await self._pool.run(groups, wanted=wanted)
        if self._on_generated is not None:
            # Generated θ (kind hyper) that missed: each is one generation on an actor,
            # however many requests of the batch shared it.
            self._on_generated(
                sum(1 for r in results if r.key is not None and not r.hit and r.error is None)
            )
        return results

    async def prefetch(self, experts: Sequence[ExpertRef]) -> None:
        await self._pool.prefetch(experts)

    async def forget_popularity(self) -> None:
        await self._pool.forget_popularity()

    def residency(self) -> dict[str, list[str]]:
        return self._pool.residency()

    def actors(self) -> list[ActorInfo]:
        return self._pool.actors()

    async def close(self) -> None:
        """Nothing: the pool belongs to the server, not to a version's batcher."""

