"""Health checks: every live actor asked about itself now and then, between requests too.

The pool learns of an actor's death from a call to it, or from its socket dropping; an
actor that takes no batches (idle, or reached over Ray's calls, with no socket) died
unseen: `/readyz` and `momlp_actor_alive` said alive, and one whose restarts were spent
was replaced only once a request found it dead. A probe that fails says so within a period;
so does one answered by another process than the last probe's: Ray restarts an actor within
seconds, mostly between two probes, and its death went uncounted (`momlp_actor_failures_total`)
with its dead process's experts still listed as resident.

A process that answers nothing at all (stopped, or frozen) was found only by a call's deadline
(`actor_call_timeout_s`, 120 s): meanwhile every batch with rows on it held its in-flight
slot, so the whole server stalled, requests for the other actors' experts too, while /readyz
said ready. A probe is answered on a thread of its own (`PROBE_GROUP`), beside any calls, so
an actor that answers no probe and no call for `unresponsive_s` is taken for hung: its
process is killed, and the rows of its calls are retried on the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from experts_store import Clock
from server.pool._dispatch import Dispatcher
from server.pool._errors import ActorDied
from server.pool._types import ActorInfo

__all__ = ["PROBE_GROUP", "check_health"]

# The Ray concurrency group (one thread) an actor answers probes in: never behind its calls.
PROBE_GROUP = "probe"

logger = logging.getLogger(__name__)


async def check_health(
    dispatcher: Dispatcher,
    *,
    probe: Callable[[str], Awaitable[ActorInfo]],
    deaths: Callable[[str], int],
    died: Callable[[str], None],
    hung: Callable[[str], None],
    replied: Callable[[str], float],
    clock: Clock,
    sleep: Callable[[float], Awaitable[None]],
    period_s: float,
    timeout_s: float,
    unresponsive_s: float,
) -> None:
    """Every `period_s`, `probe` each actor the dispatcher counts alive; one whose probe
    says it died, or that answers from another process than its last probe did with no death
    noticed between, is handed to `died` (unless a death of it was noticed meanwhile, by a
    call or its socket). A probe that times out is sent again at once, not a period later;
    one that has answered no probe since `unresponsive_s` ago, and no call since (`replied`:
    when its last call's reply came), is handed to `hung` (`unresponsive_s` 0: never; its
    calls' deadline still finds it). Runs until cancelled."""
    # Actor -> (its deaths noticed, the process its last probe found). A death noticed since
    # (a call, its socket) makes the next process expected, not news.
    known: dict[str, tuple[int, str]] = {}
    # Actor -> when the first of its probes unanswered since its last answer was sent.
    silent: dict[str, float] = {}
    while True:
        await sleep(0.0 if silent else period_s)
        for actor in dispatcher.names:
            if not dispatcher.alive(actor):
                silent.pop(actor, None)
                continue  # a revival is on it
            seen = deaths(actor)
            sent = clock.now()
            try:
                info = await asyncio.wait_for(probe(actor), timeout_s)
            except ActorDied:
                silent.pop(actor, None)
                if deaths(actor) == seen and dispatcher.alive(actor):
                    logger.warning("actor %s failed its health check: taken for dead", actor)
                    died(actor)
                continue
            except TimeoutError:
                since = silent.setdefault(actor, sent)
                if replied(actor) >= since:
                    silent[actor] = since = clock.now()  # its calls are answered: not stuck
                if (
                    unresponsive_s > 0 and clock.now() - since >= unresponsive_s
                    and deaths(actor) == seen and dispatcher.alive(actor)
                ):
                    logger.error(
                        "actor %s answered no health check and no call for %g s "
                        "(MOMLP_ACTOR_UNRESPONSIVE_S): taken for hung, its process is killed "
                        "for Ray to restart", actor, unresponsive_s,
                    )
                    del silent[actor]
                    hung(actor)
                continue
            except Exception:  # an answer no probe expects: logged, and the checks go on
                silent.pop(actor, None)
                logger.exception("actor %s: its health check failed unexpectedly", actor)
                continue
            silent.pop(actor, None)
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
