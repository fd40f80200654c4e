"""Bringing dead actors back: a pool's revivals, and the runtime that may be gone meanwhile.

A revival polls a dead actor until its runtime (Ray) has restarted it and it answers, then
marks it alive in the dispatcher; it gives up after its timeout, counted on the pool's clock
(another revival then starts after `replace_interval_s`: a restart may wait for room), or
once the runtime says the actor will not come back. Such an actor, its restarts spent, is
replaced: the pool starts a new one in its place (at most one start per actor within
`replace_interval_s`, so that an actor that dies as it starts does not loop). A call that
keeps failing may mean the runtime itself is gone (Ray's GCS stopped): then every actor
counts as dead until it answers again, and requests waiting for a revival are answered at
once.
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
    runtime will not restart it); `replace(actor)` starts a new actor in a gone one's place,
    True once it is up; `runtime_problem()` says why the runtime does not answer, or None;
    `spawn` runs a coroutine as the pool's background task; `closed()` whether the pool is
    closed. `clock` and `sleep` are the pool's, injected so that tests never wait.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        call_info: Callable[[str], Awaitable[ActorInfo]],
        replace: Callable[[str], Awaitable[bool]],
        runtime_problem: Callable[[], Awaitable[str | None]],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        closed: Callable[[], bool],
        clock: Clock,
        sleep: Callable[[float], Awaitable[None]],
        timeout_s: float,
        info_timeout_s: float,
        replace_interval_s: float,
    ) -> None:
        self._dispatcher = dispatcher
        self._call_info = call_info
        self._replace = replace
        self._replace_interval_s = replace_interval_s
        # Actor -> when a new actor was last started in its place (by the clock).
        self._replaced_at: dict[str, float] = {}
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

    async def wait_for_any(self, *, or_until: asyncio.Future[None] | None = None) -> None:
        """Wait until one running revival ends, the runtime is found gone, or `or_until` is
        done (at once when no revival runs or the runtime is gone already)."""
        running = [task for task in self._running.values() if not task.done()]
        if not running or self.unreachable is not None:
            return
        lost = asyncio.ensure_future(self._lost_runtime.wait())
        waits: list[asyncio.Future[Any]] = [*running, lost]
        if or_until is not None:
            waits.append(or_until)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
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
                    # Ray will not restart it: Ray's restarts are counted over the actor's
                    # whole life, so without a new actor a server running for weeks lost its
                    # actors one by one. Waiting out the timeout instead would hold every
                    # request for it (60 s), to end in the same "no live actor".
                    if not await self._replaced(actor):
                        return
                    gone = 0
                    deadline = self._clock.now() + self._timeout_s
                    continue
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
        # Not given up for good: a restart waiting for room (a GPU or a node coming back)
        # ends later, and nothing else asks a dead actor; it stayed dead once Ray revived it.
        logger.error(
            "actor %s did not come back within %s s; asked again in %g s",
            actor, self._timeout_s, self._replace_interval_s,
        )
        self._spawn(self._watch_later(actor, self._replace_interval_s))

    async def _replaced(self, actor: str) -> bool:
        """Start a new actor in the place of `actor`, whose restarts are spent; True once it
        is up. Within `replace_interval_s` of the last start for it, or when the start fails,
        the actor stays dead until a start after the interval (a background task)."""
        now = self._clock.now()
        last = self._replaced_at.get(actor)
        if last is not None and now - last < self._replace_interval_s:
            wait = last + self._replace_interval_s - now
            logger.error(
                "actor %s is out of restarts again %.0f s after a new actor was started in its "
                "place; the next starts in %.0f s (MOMLP_ACTOR_REPLACE_INTERVAL_S). Meanwhile its "
                "rows go to the other actors; with none left, requests get 503 actor_failed "
                "and /readyz says not ready",
                actor, now - last, wait,
            )
            self._spawn(self._watch_later(actor, wait))
            return False
        self._replaced_at[actor] = now
        logger.warning(
            "actor %s is out of restarts (MOMLP_ACTOR_MAX_RESTARTS): starting a new actor in "
            "its place", actor,
        )
        try:
            started = await self._replace(actor)
        except Exception:  # logged; tried again after the interval as a failed start is
            logger.exception("actor %s: a new actor in its place did not start", actor)
            started = False
        if not started:
            logger.error(
                "actor %s: no new actor in its place yet; the next try in %g s",
                actor, self._replace_interval_s,
            )
            self._spawn(self._watch_later(actor, self._replace_interval_s))
        return started

    async def _watch_later(self, actor: str, wait_s: float) -> None:
        await self._sleep(wait_s)
        if not self._closed() and not self._dispatcher.alive(actor):
            # A revival's probes find the actor back, or gone again (then it starts a new one).
            self.watch(actor)
