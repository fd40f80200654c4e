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
process is killed, and the rows of its calls are retried on the others. Each unanswered probe
counts for at most its own timeout: a probe whose timeout lands late says this process was
held up (stopped, starved), and an actor that answered meanwhile was killed on one such probe.

Until then a stopped actor still held every batch with rows on it, and with them the
in-flight slots: the whole server stalled for the health check's period and `unresponsive_s`
(15 s with the defaults). So the first probe that goes unanswered, with no call answered
while it waited, makes the actor a suspect (`suspect`): the pool runs its calls' groups on the
others and sends it no new ones, without killing it, until it answers again (`answered`).
Computing a batch twice is what a wrong suspicion costs, where a wrong kill costs a restart.
An actor that holds a call for over `OVERDUE_S` is probed then (`overdue`), not at the next
round: a stop waited for it, up to the whole period (10 s by default).

A suspect takes no calls, so no answered call can say it lives any more: an actor whose probes
were only late (answered after their timeout), its calls answered, was killed as hung once
suspected. So the first probe of a silence is kept out beside each one sent again (`_Probes`):
its late answer ends the silence, where a stopped process answers none.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from experts_store import Clock
from server.pool._dispatch import Dispatcher
from server.pool._errors import ActorDied
from server.pool._types import ActorInfo

__all__ = ["OVERDUE_S", "PROBE_GROUP", "check_health"]

# The Ray concurrency group (one thread) an actor answers probes in: never behind its calls.
PROBE_GROUP = "probe"

# A call out this long gets its actor probed within as long again. A batch takes milliseconds
# on a CPU; a long one (misses of large experts) only costs a probe a second.
OVERDUE_S = 1.0

logger = logging.getLogger(__name__)


@dataclass
class _Silence:
    """An actor's probes unanswered since its last answer."""

    since: float  # when the first of them was sent: a call answered after it ends the silence
    deaths: int  # its deaths noticed then: a later process's silence is its own, from zero
    seconds: float = 0.0  # how long they went unanswered, each counted up to its timeout


def _retrieve(task: asyncio.Task[ActorInfo]) -> None:
    if not task.cancelled():
        task.exception()  # a probe left behind: its failure is no news


class _Probes:
    """The probes out to each actor: at most two, the first of its silence (whose late answer
    says its process lives) and the latest sent."""

    def __init__(self, probe: Callable[[str], Awaitable[ActorInfo]]) -> None:
        self._probe = probe
        # Actor -> (probe, its deaths noticed when the probe was sent), the first one first.
        self._out: dict[str, list[tuple[asyncio.Task[ActorInfo], int]]] = {}

    async def answer(self, actor: str, seen: int, timeout_s: float) -> ActorInfo:
        """The first answer, within `timeout_s`, of a probe sent now to `actor` or of the
        first one its process (`seen`: its deaths noticed) left unanswered; `TimeoutError`
        when neither answers (both kept out), else what the probe raised."""
        out = self._out.pop(actor, [])
        kept = [(task, at) for task, at in out if at == seen][:1]
        for task, at in out:
            if (task, at) not in kept:
                task.cancel()  # the latest sent, superseded by the one sent now
        task = asyncio.ensure_future(self._probe(actor))
        task.add_done_callback(_retrieve)
        probes = [*kept, (task, seen)]
        self._out[actor] = probes
        # Not `wait_for`, which on Python 3.11 drops a cancel (the pool's close) that lands as
        # the probe ends; `wait` leaves the probes out when it times out, for the next one.
        done, _ = await asyncio.wait([task for task, _ in probes], timeout=timeout_s)
        if not done:
            raise TimeoutError
        del self._out[actor]
        for other, _ in probes:
            other.cancel()
        answered = [task for task in done if task.exception() is None]
        return (answered or list(done))[0].result()

    def drop(self, actor: str) -> None:
        """Stop waiting for `actor`'s probes (it died, or a death of it was noticed since)."""
        for task, _ in self._out.pop(actor, []):
            task.cancel()

    def drop_all(self) -> None:
        for actor in list(self._out):
            self.drop(actor)


async def check_health(
    dispatcher: Dispatcher,
    *,
    probe: Callable[[str], Awaitable[ActorInfo]],
    deaths: Callable[[str], int],
    died: Callable[[str], None],
    hung: Callable[[str], None],
    suspect: Callable[[str], None],
    answered: Callable[[str], None],
    replied: Callable[[str], float],
    clock: Clock,
    sleep: Callable[[float], Awaitable[None]],
    period_s: float,
    timeout_s: float,
    unresponsive_s: float,
    overdue: Callable[[str], bool] | None = None,
) -> None:
    """Every `period_s`, `probe` each actor the dispatcher counts alive; one whose probe
    says it died, or that answers from another process than its last probe did with no death
    noticed between, is handed to `died` (unless a death of it was noticed meanwhile, by a
    call or its socket). A probe that times out is sent again at once, not a period later,
    the first unanswered one still awaited beside it (its late answer is an answer); one
    whose probes in a row have gone unanswered for `unresponsive_s` (each counted up to
    `timeout_s`), with no call answered meanwhile (`replied`: when its last call's reply came),
    is handed to `hung` (`unresponsive_s` 0: never; its calls' deadline still finds it). An
    actor is handed to `suspect` at each probe that times out with no call answered meanwhile,
    and to `answered` at each probe it answers. With `overdue` (whether an actor holds a call
    older than `OVERDUE_S`), such an actor is probed within `OVERDUE_S` between the rounds,
    and a round of probes after a timeout sends them to the silent and overdue actors only.
    Runs until cancelled."""
    # Actor -> (its deaths noticed, the process its last probe found). A death noticed since
    # (a call, its socket) makes the next process expected, not news.
    known: dict[str, tuple[int, str]] = {}
    # Actor -> its probes unanswered since its last answer.
    silent: dict[str, _Silence] = {}
    probes = _Probes(probe)
    try:
        tick_s = period_s if overdue is None else min(period_s, OVERDUE_S)
        next_round = -math.inf
        while True:
            await sleep(0.0 if silent else tick_s)
            now = clock.now()
            full = overdue is None or now >= next_round
            if full:
                next_round = now + period_s
            for actor in dispatcher.names:
                if not dispatcher.alive(actor):
                    silent.pop(actor, None)
                    probes.drop(actor)
                    continue  # a revival is on it
                if not (full or actor in silent or (overdue is not None and overdue(actor))):
                    continue
                seen = deaths(actor)
                sent = clock.now()
                try:
                    info = await probes.answer(actor, seen, timeout_s)
                except ActorDied:
                    silent.pop(actor, None)
                    if deaths(actor) == seen and dispatcher.alive(actor):
                        logger.warning("actor %s failed its health check: taken for dead", actor)
                        died(actor)
                    continue
                except TimeoutError:
                    now = clock.now()
                    silence = silent.get(actor)
                    if silence is None or silence.deaths != seen or replied(actor) >= silence.since:
                        # Counted afresh from this probe: the first unanswered; or one to a process
                        # that came back from a death between two probes (its predecessor's silence
                        # got it killed at its own first late probe); or a call answered since.
                        silence = silent[actor] = _Silence(since=sent, deaths=seen)
                    if replied(actor) < sent:  # else a call was answered while it waited: busy
                        # At most its timeout: the rest is this process's own delay (stopped,
                        # starved, its event loop held), while an answer may have waited unread.
                        silence.seconds += min(now - sent, timeout_s)
                        if deaths(actor) == seen and dispatcher.alive(actor):
                            suspect(actor)
                    if (
                        unresponsive_s > 0 and silence.seconds >= unresponsive_s
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
                answered(actor)
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
    finally:
        probes.drop_all()
