"""Killing a Ray actor's hung process, so that Ray restarts the actor.

A process that hangs without dying (a read stuck on a network filesystem, a deadlock in a
native library, SIGSTOP) never fails its calls, so Ray never restarts it by itself. Once a
call to it is past its deadline, the pool has Ray kill it: Ray then restarts the actor as
after a death, while its restarts last (`MOMLP_ACTOR_MAX_RESTARTS`; a kill uses one), and
the pool starts a new actor in its place after that.

Ray is imported inside the function, so importing this module does not start or need Ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from experts_store import Clock
from server.pool._threads import in_daemon_thread

__all__ = ["kill_hung_process"]

logger = logging.getLogger(__name__)

# How long a probe of the process's pid may take: a stopped process answers none.
PROBE_S = 2.0
# How long the kill may take to land before the revival goes ahead regardless (Ray took
# 6.5 s to kill a SIGSTOPped worker here; a running one goes at once).
LANDING_S = 30.0
_POLL_S = 0.1


async def _pid(handle: Any) -> int | None:
    """The pid of the process answering `handle`'s calls now, or None if none answers."""
    from ray.exceptions import RayError

    try:
        pid: int = await asyncio.wait_for(handle.get_pid.remote(), PROBE_S)
    except (RayError, TimeoutError):
        return None
    return pid


async def kill_hung_process(
    actor: str, handle: Any, *, clock: Clock, sleep: Callable[[float], Awaitable[None]]
) -> None:
    """Have Ray kill the process of `actor` (`handle`) and restart the actor; return once
    that process answers no more. Never raises: a kill that fails is logged."""
    import ray

    # A process hung in one thread (a deadlock) may answer other calls until the kill lands,
    # a revival's probe among them, which would mark the doomed process alive: its pid tells
    # its answers from its successor's.
    old = await _pid(handle)

    def kill() -> None:
        ray.kill(handle, no_restart=False)

    try:
        # Off the event loop, bounded: a kill is a call to Ray's GCS, which may not answer.
        await asyncio.wait_for(in_daemon_thread(kill), LANDING_S)
    except Exception as exc:
        logger.error("actor %s: Ray did not kill its hung process: %r", actor, exc)
        return
    if old is None:
        return  # it answered no probe before the kill: it answers none after it either
    deadline = clock.now() + LANDING_S
    while clock.now() < deadline:
        if await _pid(handle) != old:
            return
        await sleep(_POLL_S)
    logger.warning(
        "actor %s: its hung process (pid %s) still answers %g s after Ray was asked to kill it",
        actor, old, LANDING_S,
    )
