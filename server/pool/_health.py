"""Health checks: every live actor asked about itself now and then, between requests too.

The pool learns of an actor's death from a call to it, or from its socket dropping; an
actor that takes no batches (idle, or reached over Ray's calls, with no socket) died
unseen: `/readyz` and `momlp_actor_alive` said alive, and one whose restarts were spent
was replaced only once a request found it dead. A probe that fails says so within a period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from server.pool._dispatch import Dispatcher
from server.pool._errors import ActorDied
from server.pool._types import ActorInfo

__all__ = ["check_health"]

logger = logging.getLogger(__name__)


async def check_health(
    dispatcher: Dispatcher,
    *,
    probe: Callable[[str], Awaitable[ActorInfo]],
    deaths: Callable[[str], int],
    died: Callable[[str], None],
    sleep: Callable[[float], Awaitable[None]],
    period_s: float,
    timeout_s: float,
) -> None:
    """Every `period_s`, `probe` each actor the dispatcher counts alive; one whose probe
    says it died is handed to `died` (unless a death of it was noticed meanwhile, by a call
    or its socket). A probe that only times out says nothing: a busy actor answers late,
    and a hung one is found by its calls' deadline. Runs until cancelled."""
    while True:
        await sleep(period_s)
        for actor in dispatcher.names:
            if not dispatcher.alive(actor):
                continue  # a revival is on it
            seen = deaths(actor)
            try:
                await asyncio.wait_for(probe(actor), timeout_s)
            except ActorDied:
                if deaths(actor) == seen and dispatcher.alive(actor):
                    logger.warning("actor %s failed its health check: taken for dead", actor)
                    died(actor)
            except TimeoutError:
                pass
