"""An in-process pool with the Ray pool's behaviour, for fast tests of everything above it.

Experts are loaded and run by the same `ActorCore` the Ray actors use, one per fake actor,
each call on a worker thread; `kill` simulates an actor dying mid-call and being restarted
(or, its restarts spent, not: then the pool starts a new one in its place), `hang` one whose
process stops answering without dying.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from experts_store import Clock, ExpertRef
from server._settings import Settings
from server.pool._actor import ActorCore
from server.pool._base import DispatchingPool
from server.pool._device import resolve_device
from server.pool._errors import ActorDied, ActorGone
from server.pool._types import ActorInfo, ActorReply

__all__ = ["FakeExpertPool"]


class FakeExpertPool(DispatchingPool):
    """`ExpertPool` without Ray: `settings.actors` in-process actors."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        failure_ttl_s: float = 30.0,
        info_timeout_s: float = 2.0,
    ) -> None:
        device = resolve_device(settings.device)
        names = [f"actor-{index}" for index in range(settings.actors)]
        super().__init__(
            names,
            device=device,
            budget_bytes=settings.cache_bytes,
            spill_queue_rows=settings.spill_queue_rows,
            clock=clock,
            sleep=sleep,
            failure_ttl_s=failure_ttl_s,
            info_timeout_s=info_timeout_s,
            call_timeout_s=settings.actor_call_timeout_s,
            replace_interval_s=settings.actor_replace_interval_s,
        )
        self._settings = settings
        self._clock_arg = clock
        self._cores = {name: self._new_core(name) for name in names}
        self._doomed: set[str] = set()
        self._hanging: set[str] = set()
        self._frozen: set[str] = set()  # hanging actors whose probes hang too
        # Actor -> set when its hung process is killed (its hung calls then fail).
        self._stuck: dict[str, asyncio.Event] = {}
        self._gone: set[str] = set()  # actors out of restarts, until replaced
        self.calls: list[tuple[str, list[int]]] = []
        self.hung_kills: list[str] = []  # actors whose hung process the pool had killed
        self.replacements: list[str] = []  # actors a new one was started for, in order
        self.failing_starts = 0  # how many of the next replacements fail to start

    def _new_core(self, name: str) -> ActorCore:
        return ActorCore(
            name=name,
            device=self._device,
            budget_bytes=self._settings.cache_bytes,
            cache_policy=self._settings.cache_policy,
            clock=self._clock_arg,
            lookahead=self._settings.lookahead,
            host_cache_bytes=self._settings.host_cache_bytes,
        )

    def core(self, actor: str) -> ActorCore:
        """The actor's logic (to inspect its cache in tests)."""
        return self._cores[actor]

    def kill(self, actor: str, *, for_good: bool = False) -> None:
        """The actor's next call dies mid-way; the actor comes back with an empty cache, or,
        `for_good` (its restarts spent), only once the pool has started a new one."""
        self._doomed.add(actor)
        if for_good:
            self._gone.add(actor)

    def hang(self, actor: str, *, frozen: bool = False) -> None:
        """The actor's next call, and every call to it after, never answers (its process
        alive) until the pool has that process killed; the actor then comes back with an
        empty cache. `frozen`: its probes go unanswered too (a stopped process), not only
        its calls (a read stuck on a hung mount)."""
        self._hanging.add(actor)
        if frozen:
            self._frozen.add(actor)
        self._stuck.setdefault(actor, asyncio.Event())

    async def _call_run(
        self, actor: str, payload: list[tuple[ExpertRef, np.ndarray]]
    ) -> ActorReply:
        self.calls.append((actor, [ref.expert_id for ref, _ in payload]))
        if actor in self._gone and actor not in self._doomed:
            raise ActorDied(actor)
        if actor in self._doomed:
            self._doomed.discard(actor)
            await self._restart(actor)
            raise ActorDied(actor)
        if actor in self._hanging:
            await self._stuck[actor].wait()
            raise ActorDied(actor)  # a killed process fails the calls it held
        core = self._cores[actor]
        try:
            reply = await asyncio.to_thread(core.run, payload)
        except Exception:
            if self._cores[actor] is not core:
                # Killed while this call was running: a dead Ray actor fails all its calls.
                raise ActorDied(actor) from None
            raise
        if self._cores[actor] is not core:
            raise ActorDied(actor)
        return reply

    async def _restart(self, actor: str) -> None:
        old = self._cores[actor]
        self._cores[actor] = self._new_core(actor)
        await asyncio.to_thread(old.close)

    async def _kill_hung(self, actor: str) -> None:
        self.hung_kills.append(actor)
        if actor in self._hanging:
            self._hanging.discard(actor)
            self._frozen.discard(actor)
            self._stuck.pop(actor).set()
        await self._restart(actor)

    async def _replace(self, actor: str) -> bool:
        self.replacements.append(actor)
        if self.failing_starts:
            self.failing_starts -= 1
            return False
        self._gone.discard(actor)
        await self._restart(actor)
        return True

    async def _call_prefetch(self, actor: str, experts: list[ExpertRef]) -> dict[str, int]:
        if actor in self._gone:
            raise ActorDied(actor)
        return await asyncio.to_thread(self._cores[actor].prefetch, experts)

    async def _call_forget_popularity(self, actor: str) -> None:
        self._cores[actor].forget_popularity()

    async def _call_info(self, actor: str) -> ActorInfo:
        if actor in self._gone:
            raise ActorGone(actor)
        if actor in self._frozen:
            await self._stuck[actor].wait()
            raise ActorDied(actor)  # a killed process fails the calls it held
        return self._cores[actor].info()

    async def _shutdown(self) -> None:
        # The shutdown kills the processes, a hung one too: its calls fail now, as a Ray
        # actor's do once killed (over its socket, at once), not at their deadlines after the
        # pool has closed (a run left pending past the close, a task past the event loop).
        for stuck in self._stuck.values():
            stuck.set()
        self._hanging.clear()
        self._frozen.clear()
        self._stuck.clear()
        for core in self._cores.values():
            await asyncio.to_thread(core.close)
