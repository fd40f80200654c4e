"""Bringing dead actors back: a pool's revivals, and the runtime that may be gone meanwhile.

A revival polls a dead actor until its runtime (Ray) has restarted it and it answers, then
marks it alive in the dispatcher; it gives up after its timeout, counted on the pool's clock,
or once the runtime says the actor will not come back. A call that keeps failing may mean
the runtime itself is gone (Ray's GCS stopped): then every actor counts as dead until it
answers again, and requests waiting for a revival are answered at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from experts_store import Clock
from server.pool._dispatch import Dispatcher
from server.pool._errors import ActorDied, ActorGone
from server.pool._types import ActorInfo

__all__ = ["Revivals"]

logger = logging.getLogger(__name__)

# A revival gives up after this many ActorGone answers in a row: one could be a call that
# raced the death's bookkeeping; three, with the poll's back-off between them, are not.
_GONE_ANSWERS = 3


class Revivals:
    """The revivals of one pool's actors (at most one running per actor).

    `call_info(actor)` asks an actor about itself (raising ActorDied, or ActorGone when its
    runtime will not restart it); `runtime_problem()` says why the runtime does not answer, or
    None; `spawn` runs a coroutine as the pool's background task; `closed()` whether the pool
    is closed. `clock` and `sleep` are the pool's, injected so that tests never wait.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        call_info: Callable[[str], Awaitable[ActorInfo]],
        runtime_problem: Callable[[], Awaitable[str | None]],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        closed: Callable[[], bool],
        clock: Clock,
        sleep: Callable[[float], Awaitable[None]],
        timeout_s: float,
        info_timeout_s: float,
    ) -> None:
        self._dispatcher = dispatcher
        self._call_info = call_info
        self._runtime_problem = runtime_problem
        self._spawn = spawn
        self._closed = closed
        self._clock = clock
        self._sleep = sleep
        self._timeout_s = timeout_s
        self._info_timeout_s = info_timeout_s
        self._running: dict[str, asyncio.Task[None]] = {}
        # Why the actors' runtime does not answer (set while it does not): requests stop
        # waiting for revivals that cannot come and get 503 at once.
        self.unreachable: str | None = None
        self._lost_runtime = asyncio.Event()

    def watch(self, actor: str, *, after: Awaitable[None] | None = None) -> None:
        """Revive `actor` (marked dead) unless a revival of it is running already; with
        `after`, only once it is done (the kill of a hung process, which may answer a probe
        until then), the revival counting as running meanwhile."""
        task = self._running.get(actor)
        if task is None or task.done():
            self._running[actor] = self._spawn(self._revive(actor, after))

    async def wait_for_any(self) -> None:
        """Wait until one running revival ends, or the runtime is found gone (at once when no
        revival runs or it is gone already)."""
        running = [task for task in self._running.values() if not task.done()]
        if not running or self.unreachable is not None:
            return
        lost = asyncio.ensure_future(self._lost_runtime.wait())
        try:
            await asyncio.wait([*running, lost], return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()

    async def wait_until_alive(self, actor: str) -> bool:
        """Wait for a running revival of `actor` to end; True if it is alive."""
        task = self._running.get(actor)
        if task is not None:
            await asyncio.shield(task)
        return self._dispatcher.alive(actor)

    def runtime_lost(self, problem: str) -> None:
        """The runtime does not answer: every actor counts as dead until it answers again
        (so /readyz says not ready), and requests waiting for a revival get 503 now."""
        if self.unreachable is not None or self._closed():
            return
        self.unreachable = problem
        self._lost_runtime.set()
        logger.error(
            "%s: every actor counts as dead, and requests get 503 actor_failed until it answers",
            problem,
        )
        for name in self._dispatcher.names:
            if self._dispatcher.alive(name):
                # Not a death of its process: the processes may live on, and a call's later
                # failure is then news about its process.
                self._dispatcher.mark_dead(name)
                self.watch(name)

    async def _revive(self, actor: str, after: Awaitable[None] | None) -> None:
        """Poll a dead actor until its runtime has restarted it (or give up after the timeout).

        Calls to a restarting Ray actor fail at once (ActorUnavailableError) rather than
        queue, so this polls with a growing delay instead of waiting on one call.
        """
        if after is not None:
            try:
                await after
            except Exception:  # the probes below tell whether the actor came back all the same
                logger.exception("actor %s: its hung process could not be killed", actor)
        # By the clock: a call that fails slowly (hanging up to its timeout, or the runtime
        # check after it) takes its time out of the wait as a back-off's sleep does.
        deadline = self._clock.now() + self._timeout_s
        delay, gone = 0.05, 0
        while self._clock.now() < deadline:
            try:
                await asyncio.wait_for(self._call_info(actor), self._info_timeout_s)
            except (ActorDied, TimeoutError) as exc:
                # A call that hangs, or keeps failing, may mean that the runtime itself is
                # gone (Ray's GCS stopped), which no wait will mend: ask it.
                problem = await self._runtime_problem()
                if problem is not None:
                    self.runtime_lost(problem)
                gone = gone + 1 if isinstance(exc, ActorGone) else 0
                if gone >= _GONE_ANSWERS:
                    # Waiting out the timeout would hold every request for it (60 s), to end
                    # in the same "no live actor".
                    logger.error(
                        "actor %s is dead for good: its runtime will not restart it again "
                        "(MOMLP_ACTOR_MAX_RESTARTS); requests that need it fail with 503 "
                        "actor_failed, and /readyz says not ready once no actor is left",
                        actor,
                    )
                    return
                await self._sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            if self.unreachable is not None:
                self.unreachable = None
                self._lost_runtime.clear()
                logger.warning("the actors' runtime answers again")
            self._dispatcher.mark_alive(actor)
            logger.info("actor %s is back", actor)
            return
        logger.error("actor %s did not come back within %s s", actor, self._timeout_s)
