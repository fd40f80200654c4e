"""The shared dispatch/retry logic of expert pools (`DispatchingPool`).

Subclasses: `RayExpertPool` (_ray, real actors) and `FakeExpertPool` (_fake, in-process, for
tests of the layers above). This module does not import Ray. Experts are placed, remembered
as failed and reported resident by their content hash, so all of it carries over from one
store version to the next.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from experts_store import Clock, ExpertRef, MonotonicClock
from server._exceptions import ActorFailed, PoolClosed
from server.pool._actor import ERROR_LOAD
from server.pool._counts import ActorCounts
from server.pool._dispatch import Dispatcher, forget_scores
from server.pool._errors import ActorDied
from server.pool._failures import LoadFailures
from server.pool._health import OVERDUE_S, check_health
from server.pool._prefetch import prefetch_plan
from server.pool._results import failed_result, group_result, rows_array
from server.pool._retries import Retries
from server.pool._revival import Revivals
from server.pool._settle import carry_calls
from server.pool._suspects import Suspects
from server.pool._types import ActorInfo, ActorReply, Group, GroupResult

__all__ = ["DispatchingPool"]

logger = logging.getLogger(__name__)

# How long a close waits for its cancelled background tasks before cancelling them again.
_RECANCEL_S = 0.1

class DispatchingPool(ABC):
    """Places groups on actors, retries a dead actor's groups, remembers bad experts.

    Subclasses only move calls to actors (`_call_run`, `_call_prefetch`, `_call_info`),
    raising `ActorDied` when the actor died during the call, and start actors anew
    (`_replace`, `_kill_hung`). `clock` (failure memory) and
    `sleep` (a revival's back-off) are injectable so that tests never wait.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        device: str,
        budget_bytes: int,
        spill_queue_rows: int,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        failure_ttl_s: float = 30.0,
        revive_timeout_s: float = 60.0,
        info_timeout_s: float = 2.0,
        call_timeout_s: float = 120.0,
        replace_interval_s: float = 60.0,
    ) -> None:
        self._dispatcher = Dispatcher(names, spill_queue_rows=spill_queue_rows)
        self._device = device
        self._budget_bytes = budget_bytes
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._sleep = sleep if sleep is not None else asyncio.sleep
        self._failures = LoadFailures(failure_ttl_s)
        self._background: set[asyncio.Task[Any]] = set()
        self._info_timeout_s = info_timeout_s
        self._revivals = Revivals(
            self._dispatcher,
            call_info=self._call_info,
            replace=self._replace,
            runtime_problem=self._runtime_problem,
            spawn=self._spawn,
            closed=lambda: self._closed,
            clock=self._clock,
            sleep=self._sleep,
            timeout_s=revive_timeout_s,
            info_timeout_s=info_timeout_s,
            replace_interval_s=replace_interval_s,
        )
        # Actor -> deaths of its processes noticed so far. A call that fails after a death
        # noticed since it started went to that process (or one that dies too; see
        # `_run_on`): its failure says nothing new about the actor, which may be back by now.
        self._deaths = dict.fromkeys(names, 0)
        self._counts = ActorCounts()
        # Actor -> when its last call's reply came (the health checks' sign of life).
        self._replied_at: dict[str, float] = {}
        self._suspects = Suspects()
        # Past it a run or prefetch call is given up: its actor is taken for hung.
        self._call_timeout_s = call_timeout_s
        self._closed = False

    @property
    def dispatcher(self) -> Dispatcher:
        return self._dispatcher

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes

    @property
    def device(self) -> str:
        return self._device

    @abstractmethod
    async def _call_run(
        self, actor: str, payload: list[tuple[ExpertRef, np.ndarray]]
    ) -> ActorReply:
        """Run the groups on `actor`; raise `ActorDied` if it died."""

    @abstractmethod
    async def _call_prefetch(self, actor: str, experts: list[ExpertRef]) -> dict[str, int]:
        """Warm `actor`'s cache; returns its resident experts."""

    @abstractmethod
    async def _call_forget_popularity(self, actor: str) -> None:
        """Have `actor`'s cache count popularity afresh; raise `ActorDied` if it died."""

    @abstractmethod
    async def _call_info(self, actor: str) -> ActorInfo:
        """Ask `actor` about itself; raise `ActorDied` if it is dead or restarting (Ray
        fails a restarting actor's calls at once), `ActorGone` if it will not come back."""

    @abstractmethod
    async def _replace(self, actor: str) -> bool:
        """Start a new actor in the place of `actor`, which its runtime will not restart
        again; True once it answers, False when it did not start (then nothing of it is left
        running)."""

    @abstractmethod
    async def _kill_hung(self, actor: str) -> None:
        """Have `actor`'s process, hung in a call, killed for its runtime to restart; return
        once it answers no more (a revival's probe then finds its successor)."""

    async def run(
        self, groups: list[Group], *, wanted: Callable[[], bool] | None = None
    ) -> list[GroupResult]:
        """Run every group on some actor; results in the order of `groups`.

        A group whose expert cannot be loaded comes back with `error` set; an actor that dies
        mid-call has its groups retried elsewhere (or on the restarted actor), up to
        `MAX_RETRIES` times, so that two actors dying close together still lose nothing;
        past that, `ActorFailed`. A dead call produced no answer, so nothing is answered twice.
        A call not answered within `call_timeout_s` counts as its actor's death: it is given
        up (a late reply is never read) and its actor's process killed for Ray to restart.
        A stale failure (a call to an actor's previous process, whose death was already
        noticed) is retried on a budget of its own, so that it does not use up one of those
        retries. A failure is raised as it comes, while the batch's other calls go on to
        their end: `calls_settled(error)` returns once they have. A death or hang when
        `wanted()` says no caller waits any more raises `ActorFailed` instead of retrying.
        """
        if self._closed:
            raise PoolClosed()
        results: list[GroupResult | None] = [None] * len(groups)
        todo: list[int] = []
        now = self._clock.now()
        for index, group in enumerate(groups):
            remembered = self._failures.remembered(group.expert.sha256, now)
            if remembered is not None:
                results[index] = failed_result(
                    group.expert_id, remembered[0], ERROR_LOAD, actor="",
                    retry_after_s=remembered[1],
                )
            else:
                todo.append(index)
        if todo:
            calls: list[asyncio.Task[None]] = []  # every actor call of this run, retries too
            try:
                retries = Retries() if wanted is None else Retries(wanted=wanted)
                await self._dispatch(groups, todo, results, calls, retries)
            except Exception as exc:
                carry_calls(exc, calls)
                raise
        return [result for result in results if result is not None]

    async def _dispatch(
        self,
        groups: list[Group],
        indices: list[int],
        results: list[GroupResult | None],
        calls: list[asyncio.Task[None]],
        retries: Retries,
    ) -> None:
        live = self._dispatcher.live_actors()
        if not [a for a in live if a not in retries.exclude]:
            # Every live actor failed this run, or none is live. One that is no suspect now
            # answers again (Ray restarted it since it died, or it answered since it was given
            # up on): it takes the groups at once. The run waited for another actor's revival
            # (up to `revive_timeout_s`) while it stood by.
            if all(actor in self._suspects for actor in live):
                # Wait for Ray to restart one (a fresh process, so the one that failed is fine
                # again) or for a suspect to answer again.
                back = self._suspects.back()
                try:
                    await self._revivals.wait_for_any(or_until=back)
                finally:
                    back.cancel()
                if self._closed:
                    # The close ended the revival it waited for: an answer of the close's, not
                    # "no live actor" (503 actor_failed) as if the actors had failed.
                    raise PoolClosed()
                # The wait may have outlasted every request's deadline (a start can take
                # MOMLP_ACTOR_START_TIMEOUT_S): the slot is freed rather than rows computed for
                # no one.
                retries.check_wanted("*", "died")
            retries = retries.anywhere()
        exclude = retries.exclude
        if self._suspects:
            exclude = self._suspects.avoid(exclude, self._dispatcher.live_actors())
        placement = self._dispatcher.place(
            [(groups[i].expert.sha256, int(groups[i].rows.shape[0])) for i in indices],
            exclude=exclude,
        )
        by_actor: dict[str, list[int]] = {}
        unplaced = 0
        for index, actor in zip(indices, placement, strict=True):
            if actor is None:
                unplaced += 1
            else:
                by_actor.setdefault(actor, []).append(index)
        # Each call takes its actor's placed rows off this as its first step and completes
        # them when it ends; a call cancelled before that step (gather cancelled at once)
        # never runs, so what is left here is completed after: else the dispatcher counts
        # those rows as queued for good and steers experts away from their home actor.
        placed = {
            actor: sum(int(groups[i].rows.shape[0]) for i in idx) for actor, idx in by_actor.items()
        }
        if unplaced:
            for actor, rows in placed.items():
                self._dispatcher.complete(actor, rows)
            reason = "no live actor in the pool"
            if self._revivals.unreachable is not None:
                reason += f": {self._revivals.unreachable}"
            raise ActorFailed(actor="*", reason=reason)
        # Tasks made here rather than by gather (which makes one per call all the same), so
        # that `calls` holds them for `calls_settled`.
        loop = asyncio.get_running_loop()
        started = [
            loop.create_task(self._run_on(actor, groups, idx, results, placed, calls, retries))
            for actor, idx in by_actor.items()
        ]
        calls.extend(started)
        try:
            # The first failure is raised at once, the other calls left to end on their own
            # (each completes its own rows): waiting for them turned a 503 into a 504 behind
            # a slow sibling. The caller waits for them with `calls_settled`.
            await asyncio.gather(*started)
        finally:
            for actor, rows in placed.items():
                self._dispatcher.complete(actor, rows)

    async def _run_on(
        self,
        actor: str,
        groups: list[Group],
        indices: list[int],
        results: list[GroupResult | None],
        placed: dict[str, int],
        calls: list[asyncio.Task[None]],
        retries: Retries,
    ) -> None:
        rows = placed.pop(actor)
        payload = [(groups[i].expert, rows_array(groups[i].rows)) for i in indices]
        deaths = self._deaths[actor]
        # One timer per call. A call given up is cancelled: a late reply is never read.
        deadline = asyncio.timeout(self._call_timeout_s)
        tracked = self._suspects.track(
            actor, deadline, may_give_up=retries.suspects > 0, now=self._clock.now()
        )
        died = hung = False
        try:
            async with deadline:
                reply = await self._call_run(actor, payload)
        except ActorDied:
            died = True
        except TimeoutError:
            if not deadline.expired():
                raise
            died = hung = not tracked.given_up
        finally:
            self._suspects.done(actor, tracked)
            self._dispatcher.complete(actor, rows)
        if tracked.given_up and not died:
            # Its actor answers no health check (`_suspects`): alive, and left to them.
            if self._closed:
                raise PoolClosed()
            retries = retries.after_suspect(actor)
            await self._dispatch(groups, indices, results, calls, retries)
            return
        if died:
            if self._closed:
                # Closed under the call: no revival to start, nothing to retry on.
                raise PoolClosed()
            # A death noticed while this call ran makes its failure stale: Ray may fail the
            # old process's calls after it restarted the actor and the new process answered;
            # marking that one dead would drop its cache table and revive it for nothing, so
            # the groups may go to it again. (A call Ray queued for the restarted process,
            # which then died too, passes for stale as well: its retry, or the socket's
            # drop, finds that death; so does a call given up after a sibling's hang.)
            if self._deaths[actor] != deaths:
                retries = retries.after_stale(actor, hung=hung)
                logger.info("actor %s: a call to its previous process %s; retrying %s "
                            "groups", actor, "hung" if hung else "failed", len(indices))
            else:
                if hung:
                    logger.error(
                        "actor %s did not answer within %g s (MOMLP_ACTOR_CALL_TIMEOUT_S): "
                        "taken for hung, its process is killed for Ray to restart",
                        actor, self._call_timeout_s,
                    )
                # A hang is a death (its process is killed): it uses a retry as one does.
                self._actor_died(actor, hung=hung)
                retries = retries.after_death(actor, hung=hung)
                logger.warning("actor %s %s mid-call; retrying %s groups",
                               actor, "hung" if hung else "died", len(indices))
            await self._dispatch(groups, indices, results, calls, retries)
            return
        self._dispatcher.update_residency(actor, reply.resident)
        if self._suspects:
            self._trusted(actor)
        if self._deaths[actor] == deaths:
            # Else this reply is its dead process's, whose counts were added in at its death:
            # taken as the new process's, they would count twice.
            self._counts.replied(actor, reply.counts, reply.process)
        now = self._replied_at[actor] = self._clock.now()
        for index, outcome in zip(indices, reply.results, strict=True):
            retry_after_s = None
            if outcome.error_kind == ERROR_LOAD and outcome.error is not None:
                retry_after_s = self._failures.note(
                    groups[index].expert, actor, outcome.error, now
                )
            results[index] = group_result(outcome, reply, retry_after_s)

    def _actor_lost(self, actor: str, reason: str) -> None:
        """`actor`'s process is gone (its socket dropped): dead from now, not from the next
        call to it, so that the dispatcher and /readyz know while no request is in flight."""
        if self._closed or not self._dispatcher.alive(actor):
            return
        logger.warning("actor %s dropped its connection (%s)", actor, reason)
        self._actor_died(actor)

    def _actor_died(self, actor: str, *, hung: bool = False) -> None:
        """A process of `actor` is known dead, or `hung` (then killed): no calls to it until
        its restart answers."""
        self._deaths[actor] += 1
        self._suspects.clear(actor)  # its revival decides when it takes groups again
        self._counts.died(actor, hung=hung)
        self._dispatcher.mark_dead(actor)
        self._revivals.watch(actor, after=self._spawn(self._kill_hung(actor)) if hung else None)

    def _suspect(self, actor: str) -> None:
        """`actor` left a health check unanswered: its calls' groups run elsewhere (`_suspects`)."""
        first = actor not in self._suspects
        given_up = self._suspects.suspect(actor, self._dispatcher.live_actors())
        if first or given_up:
            logger.warning(
                "actor %s answered no health check in %g s: %s of its calls given up and run "
                "on the other actors, and it takes no new ones until it answers",
                actor, self._info_timeout_s, given_up,
            )

    def _trusted(self, actor: str) -> None:
        if self._suspects.answered(actor):
            logger.info("actor %s answers again: it takes groups again", actor)

    async def _runtime_problem(self) -> str | None:
        """Why the runtime the actors live in does not answer now, or None when it does (or
        when this pool cannot tell: the default)."""
        return None

    def _runtime_lost(self, problem: str) -> None:
        """The runtime does not answer (a subclass found out): see `Revivals.runtime_lost`."""
        self._revivals.runtime_lost(problem)

    def start_health_checks(self, period_s: float, unresponsive_s: float = 0.0) -> None:
        """Probe every live actor each `period_s` from now on, and take one that answers
        nothing for `unresponsive_s` for hung (`_health`); call from the event loop. The
        pool's close ends them."""
        self._spawn(check_health(
            self._dispatcher, probe=self._call_info, deaths=self._deaths.__getitem__,
            died=self._actor_died, hung=functools.partial(self._actor_died, hung=True),
            suspect=self._suspect, answered=self._trusted,
            replied=lambda actor: self._replied_at.get(actor, -math.inf), clock=self._clock,
            sleep=self._sleep, period_s=period_s, timeout_s=self._info_timeout_s,
            unresponsive_s=unresponsive_s, overdue=self._overdue,
        ))

    def _overdue(self, actor: str) -> bool:
        return self._suspects.holds_call_since(actor, self._clock.now() - OVERDUE_S)

    async def wait_until_alive(self, actor: str) -> bool:
        """Wait for a pending revival of `actor` to finish; True if it is alive."""
        return await self._revivals.wait_until_alive(actor)

    async def prefetch(self, experts: Sequence[ExpertRef]) -> None:
        """Ask the actor each expert's rows will go to to start loading it, where that actor
        does not hold it yet; returns without waiting."""
        if self._closed:
            return
        plan = prefetch_plan(experts, self._dispatcher, self._failures, self._clock.now())
        for actor, refs in plan.items():
            if actor in self._suspects:
                # Its rows go elsewhere, and the call would wait as its calls do, one more
                # task for each batch until it answers or is killed.
                continue
            self._spawn(self._prefetch_on(actor, refs))

    async def _prefetch_on(self, actor: str, experts: list[ExpertRef]) -> None:
        try:
            async with asyncio.timeout(self._call_timeout_s):
                resident = await self._call_prefetch(actor, experts)
        except (ActorDied, TimeoutError):
            # The next run on that actor notices and retries (a hung one: past its deadline).
            return
        self._dispatcher.update_residency(actor, resident)

    async def forget_popularity(self) -> None:
        """Every live actor's cache counts popularity afresh; a dead one starts afresh anyway.
        The placement's cached scores go too (`forget_scores`): this is a new version."""
        if self._closed:
            return
        forget_scores()
        alive = [name for name in self._dispatcher.names if self._dispatcher.alive(name)]
        results = await asyncio.gather(
            *(self._call_forget_popularity(name) for name in alive), return_exceptions=True
        )
        for name, result in zip(alive, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, ActorDied):
                logger.warning("actor %s kept its popularity counts: %r", name, result)

    def residency(self) -> dict[str, list[str]]:
        """Content hash -> actors holding that expert, as of their latest replies."""
        return {str(key): actors for key, actors in self._dispatcher.residency().items()}

    def actors(self) -> list[ActorInfo]:
        infos = []
        for name in self._dispatcher.names:
            resident = self._dispatcher.resident(name)
            suspicions, given_up = self._suspects.counts(name)
            infos.append(
                ActorInfo(
                    name=name,
                    device=self._device,
                    resident_bytes=sum(resident.values()),
                    budget_bytes=self._budget_bytes,
                    resident=sorted(str(key) for key in resident),
                    alive=self._dispatcher.alive(name),
                    counts=self._counts.total(name), failures=self._counts.failures(name),
                    suspect=name in self._suspects, suspicions=suspicions,
                    given_up_calls=given_up,
                )
            )
        return infos

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        self._closed = True
        while self._background:
            # Cancelled again until they end: on Python 3.11, `asyncio.wait_for` drops a cancel
            # that lands as the call it waits for ends, and a loop (the health checks, a
            # revival) then goes on for good, and so did this close.
            pending = list(self._background)
            for task in pending:
                task.cancel()
            done, _ = await asyncio.wait(pending, timeout=_RECANCEL_S)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: an error on the way out is no news
        await self._shutdown()

    @abstractmethod
    async def _shutdown(self) -> None:
        """Release the actors."""
