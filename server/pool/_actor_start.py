"""Starting Ray actors: the pool's first ones, and one in the place of an actor whose
restarts are spent.

Ray counts an actor's restarts over its whole life; once they are spent it never restarts
the actor again. The pool then starts a new actor with the same options under the same
name (`Revivals` decides when). Every call to Ray's GCS here is off the event loop and
bounded: a GCS that does not answer must not hold the revival for good.

Ray is imported inside the functions, so importing this module does not start or need Ray.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from server.pool._threads import in_daemon_thread

__all__ = [
    "StartStopped",
    "cluster_room",
    "kill_bounded",
    "last_line",
    "start_in_place",
    "wait_until_up",
]

logger = logging.getLogger(__name__)

# How often a start waiting for its actors looks at its stop event.
_STOP_POLL_S = 0.2


class StartStopped(Exception):
    """The pool's start was asked to stop before its actors were up."""


def wait_until_up(refs: list[Any], timeout_s: float, stop: threading.Event | None) -> None:
    """Until every ref is ready, in slices, so a set `stop` ends the wait at once; raises
    Ray's GetTimeoutError past `timeout_s`, as `ray.get(refs, timeout=...)` does."""
    import ray
    from ray.exceptions import GetTimeoutError

    deadline = time.monotonic() + timeout_s
    pending = refs
    while pending:
        if stop is not None and stop.is_set():
            raise StartStopped
        left = deadline - time.monotonic()
        if left <= 0:
            raise GetTimeoutError(f"{len(pending)} actor(s) not up within {timeout_s:g} s")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, _STOP_POLL_S))


# How long a creation or a kill (each a call to Ray's GCS) may take.
GCS_CALL_S = 30.0


def last_line(text: str) -> str:
    """The last non-blank line of a remote traceback: the exception and its message."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


async def kill_bounded(actor: str, handle: Any) -> None:
    """Have Ray kill `handle`'s actor for good, waiting at most `GCS_CALL_S` (a GCS that
    does not answer: Ray's own limit then ends the server). Never raises."""
    import ray

    kill = functools.partial(ray.kill, handle, no_restart=True)
    try:
        await asyncio.wait_for(in_daemon_thread(kill), GCS_CALL_S)
    except Exception as exc:
        logger.warning("actor %s: Ray did not kill an actor of its: %r", actor, exc)


def cluster_room() -> str:
    """What the cluster has, for an error about actors not placed: its resources in all
    and free (read before the waiting actors are killed and give theirs back)."""
    import ray

    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    available = ray.available_resources()  # type: ignore[no-untyped-call]
    return f"the cluster has {total} in all, {available} free"


async def start_in_place(
    actor: str,
    start: Callable[[str], Any],
    *,
    adopt: Callable[[Any], None],
    timeout_s: float,
) -> bool:
    """Start a new actor named `actor` (`start(actor)` makes its handle) and wait until it
    answers, at most `timeout_s`; True once it does. `adopt(handle)` is called as soon as
    the handle exists, so that a pool closed meanwhile kills it. One not up in time is
    killed (nothing of it stays placed) and the log says what the cluster has free."""
    from ray.exceptions import RayError

    try:
        # A handle made after this wait is dropped, and Ray ends an actor without one.
        handle = await asyncio.wait_for(in_daemon_thread(start, actor), GCS_CALL_S)
    except TimeoutError:
        logger.error("actor %s: Ray did not create a new actor within %g s", actor, GCS_CALL_S)
        return False
    adopt(handle)
    try:
        async with asyncio.timeout(timeout_s):
            pid = await handle.get_pid.remote()
    except (RayError, TimeoutError) as exc:
        if isinstance(exc, TimeoutError):
            # What the operator must mend is most often room: say what the cluster has, as
            # a failed start of the server does (read before the kill gives back its share).
            room = await in_daemon_thread(cluster_room)
            reason = (
                f"not placed and up within {timeout_s:g} s (MOMLP_ACTOR_START_TIMEOUT_S); {room}"
            )
        else:
            reason = last_line(str(exc))
        logger.error("actor %s: the new actor in its place did not start: %s", actor, reason)
        await kill_bounded(actor, handle)
        return False
    logger.info("actor %s: a new actor in its place is up (pid %s)", actor, pid)
    return True
