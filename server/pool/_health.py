"""Health checks: every live actor asked about itself now and then, between requests too.

The pool learns of an actor's death from a call to it, or from its socket dropping; an
actor that takes no batches (idle, or reached over Ray's calls, with no socket) died
unseen: `/readyz` and `momlp_actor_alive` said alive, and one whose restarts were spent
was replaced only once a request found it dead. A probe that fails says so within a period;
so does one answered by another process than the last probe's: Ray restarts an actor within
seconds, mostly between two probes, and its death went uncounted (`momlp_actor_failures_total`)
with its dead process's experts still listed as resident.
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
    says it died, or that answers from another process than its last probe did with no death
    noticed between, is handed to `died` (unless a death of it was noticed meanwhile, by a
    call or its socket). A probe that only times out says nothing: a busy actor answers late,
    and a hung one is found by its calls' deadline. Runs until cancelled."""
    # Actor -> (its deaths noticed, the process its last probe found). A death noticed since
    # (a call, its socket) makes the next process expected, not news.
    known: dict[str, tuple[int, str]] = {}
    while True:
        await sleep(period_s)
        for actor in dispatcher.names:
            if not dispatcher.alive(actor):
                continue  # a revival is on it
            seen = deaths(actor)
            try:
                info = await asyncio.wait_for(probe(actor), timeout_s)
            except ActorDied:
                if deaths(actor) == seen and dispatcher.alive(actor):
                    logger.warning("actor %s failed its health check: taken for dead", actor)
                    died(actor)
                continue
            except TimeoutError:
                continue
            except Exception:  # an answer no probe expects: logged, and the checks go on
                logger.exception("actor %s: its health check failed unexpectedly", actor)
                continue
            last = known.get(actor)
            if (
                last is not None and last[0] == seen and info.process and last[1]
                and info.process != last[1] and deaths(actor) == seen
                and dispatcher.alive(actor)
            ):
                logger.warning(
                    "actor %s answered its health check from a new process: its last one "
                    "ended unseen, taken for dead", actor,
                )
                died(actor)
            known[actor] = (deaths(actor), info.process)
