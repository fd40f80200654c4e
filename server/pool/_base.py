"""The shared dispatch/retry logic of expert pools (`DispatchingPool`).

Subclasses: `RayExpertPool` (_ray, real actors) and `FakeExpertPool` (_fake, in-process, for
tests of the layers above). This module does not import Ray. Experts are placed, remembered
as failed and reported resident by their content hash, so all of it carries over from one
store version to the next.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from experts_store import Clock, ExpertRef, ExpertTooLarge, MonotonicClock
from server._exceptions import ActorFailed, PoolClosed
from server.pool._actor import ERROR_LOAD
from server.pool._dispatch import Dispatcher
from server.pool._errors import ActorDied
from server.pool._revival import Revivals
from server.pool._types import ActorInfo, ActorReply, CacheCounts, Group, GroupResult

__all__ = ["DispatchingPool", "check_budget"]

logger = logging.getLogger(__name__)

# Retries of a dead actor's groups: one covers a single death, the second two deaths close
# together (the retry's actor dying too). Each attempt that died produced no answer.
MAX_RETRIES = 2

_EMPTY = torch.empty(0, 0)



def check_budget(experts: Iterable[ExpertRef], budget_bytes: int) -> None:
    """Refuse a store version in which some expert can never fit in one actor's cache."""
    for ref in experts:
        if ref.nbytes > budget_bytes:
            raise ExpertTooLarge(
                expert_id=ref.expert_id, nbytes=ref.nbytes, budget_bytes=budget_bytes
            )


def _rows_array(rows: torch.Tensor) -> np.ndarray:
    """A group's rows as a float32 C-contiguous array, sharing the tensor's memory.

    The kinds' groups are already that (views of one gathered batch); detach, to and
    contiguous are then no-ops that still cost a dispatch each, per group, on the event loop.
    """
    if rows.dtype is torch.float32 and not rows.requires_grad and rows.is_contiguous():
        return rows.numpy()
    return rows.detach().to(torch.float32).contiguous().numpy()


_NONE = CacheCounts()


def _added(a: CacheCounts, b: CacheCounts) -> CacheCounts:
    return CacheCounts(
        evictions=a.evictions + b.evictions, loads=a.loads + b.loads,
        load_bytes=a.load_bytes + b.load_bytes,
    )


def _to_tensor(array: np.ndarray | None) -> torch.Tensor:
    if array is None:
        return _EMPTY
    # Arrays from Ray's object store are read-only; torch needs writable memory.
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class DispatchingPool(ABC):
    """Places groups on actors, retries a dead actor's groups, remembers bad experts.

    Subclasses only move calls to actors (`_call_run`, `_call_prefetch`, `_call_info`) and
    raise `ActorDied` when the actor died during the call. `clock` (failure memory) and
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
    ) -> None:
        self._dispatcher = Dispatcher(names, spill_queue_rows=spill_queue_rows)
        self._device = device
        self._budget_bytes = budget_bytes
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._sleep = sleep if sleep is not None else asyncio.sleep
        self._failure_ttl_s = failure_ttl_s
        # Content hash -> (reason, until when): a bad file is not read again for a while. A
        # republished fix has another hash, so it is tried at once.
        self._failures: dict[str, tuple[str, float]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._revivals = Revivals(
            self._dispatcher,
            call_info=self._call_info,
            runtime_problem=self._runtime_problem,
            spawn=self._spawn,
            closed=lambda: self._closed,
            clock=self._clock,
            sleep=self._sleep,
            timeout_s=revive_timeout_s,
            info_timeout_s=info_timeout_s,
        )
        # Actor -> deaths of its processes noticed so far. A call that fails after a death
        # noticed since it started went to that process (or one that dies too; see
        # `_run_on`): its failure says nothing new about the actor, which may be back by now.
        self._deaths = dict.fromkeys(names, 0)
        self._counts: dict[str, CacheCounts] = {}
        # Actor -> the counts of its processes that died: the current process's are added to
        # them, so that an actor's counters only grow (a restarted process counts from 0, and
        # a scrape after its first reply saw no reset when it had loaded as much again).
        self._counts_before: dict[str, CacheCounts] = {}
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
        """Ask `actor` about itself (waits for a restarting actor to come back)."""

    async def run(self, groups: list[Group]) -> list[GroupResult]:
        """Run every group on some actor; results in the order of `groups`.

        A group whose expert cannot be loaded comes back with `error` set; an actor that dies
        mid-call has its groups retried elsewhere (or on the restarted actor), up to
        `MAX_RETRIES` times, so that two actors dying close together still lose nothing;
        past that, `ActorFailed`. A dead call produced no answer, so nothing is answered twice.
        A stale failure (a call to an actor's previous process, whose death was already
        noticed) is retried on a budget of its own, so that it does not use up one of those
        retries. A failure is raised as it comes; the batch's other calls go on to their end.
        """
        if self._closed:
            raise PoolClosed()
        results: list[GroupResult | None] = [None] * len(groups)
        todo: list[int] = []
        now = self._clock.now()
        for index, group in enumerate(groups):
            remembered = self._failures.get(group.expert.sha256)
            if remembered is not None and remembered[1] > now:
                results[index] = _failed(
                    group.expert_id, remembered[0], ERROR_LOAD, actor="",
                    retry_after_s=remembered[1] - now,
                )
            else:
                todo.append(index)
        if todo:
            await self._dispatch(
                groups, todo, results, retries_left=MAX_RETRIES, stale_left=MAX_RETRIES,
                exclude=frozenset(),
            )
        return [result for result in results if result is not None]

    async def _dispatch(
        self,
        groups: list[Group],
        indices: list[int],
        results: list[GroupResult | None],
        *,
        retries_left: int,
        stale_left: int,
        exclude: frozenset[str],
    ) -> None:
        if not [a for a in self._dispatcher.live_actors() if a not in exclude]:
            # Every actor is dead or the one that just failed: wait for Ray to restart one
            # (a restarted actor is a fresh process, so the one that failed is fine again).
            await self._revivals.wait_for_any()
            if self._closed:
                # The close ended the revival it waited for: an answer of the close's, not
                # "no live actor" (503 actor_failed) as if the actors had failed.
                raise PoolClosed()
            exclude = frozenset()
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
        calls = [
            self._run_on(actor, groups, idx, results, placed, retries_left=retries_left,
                         stale_left=stale_left, exclude=exclude)
            for actor, idx in by_actor.items()
        ]
        try:
            # The first failure is raised at once, the other calls left to end on their own
            # (each completes its own rows): waiting for them turned a 503 into a 504 behind
            # a slow sibling. So a failed batch's slot is free while they still compute.
            await asyncio.gather(*calls)
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
        *,
        retries_left: int,
        stale_left: int,
        exclude: frozenset[str],
    ) -> None:
        rows = placed.pop(actor)
        payload = [(groups[i].expert, _rows_array(groups[i].rows)) for i in indices]
        deaths = self._deaths[actor]
        try:
            reply = await self._call_run(actor, payload)
        except ActorDied:
            died = True
        else:
            died = False
        finally:
            self._dispatcher.complete(actor, rows)
        if died:
            if self._closed:
                # Closed under the call: no revival to start, nothing to retry on.
                raise PoolClosed()
            # A death noticed while this call ran makes its failure stale: Ray may fail the
            # old process's calls after it restarted the actor and the new process answered;
            # marking that one dead would drop its cache table and revive it for nothing, so
            # the groups may go to it again. (A call Ray queued for the restarted process,
            # which then died too, passes for stale as well: its retry, or the socket's
            # drop, finds that death.)
            stale = self._deaths[actor] != deaths
            if stale:
                # Not a death of its own: it does not use up a retry that a next death may
                # need (its own budget still ends a chase of an actor that keeps dying).
                if stale_left <= 0:
                    raise ActorFailed(actor=actor, reason="died again during the retries")
                logger.info("actor %s: a call to its previous process failed; retrying %s "
                            "groups", actor, len(indices))
                stale_left -= 1
            else:
                self._actor_died(actor)
                exclude |= {actor}
                if retries_left <= 0:
                    raise ActorFailed(actor=actor, reason="died again during the retries")
                logger.warning("actor %s died mid-call; retrying %s groups", actor, len(indices))
                retries_left -= 1
            await self._dispatch(
                groups, indices, results, retries_left=retries_left, stale_left=stale_left,
                exclude=exclude,
            )
            return
        self._dispatcher.update_residency(actor, reply.resident)
        if self._deaths[actor] == deaths:
            # Else this reply is its dead process's, whose counts were added in at its death:
            # taken as the new process's, they would count twice.
            self._counts[actor] = reply.counts
        now = self._clock.now()
        for index, outcome in zip(indices, reply.results, strict=True):
            retry_after_s = None
            if outcome.error_kind == ERROR_LOAD and outcome.error is not None:
                expert = groups[index].expert
                key = expert.sha256
                remembered = self._failures.get(key)
                if remembered is None or remembered[1] <= now:
                    # Once per file and memory: the actor logs it too, but on its own node
                    # (log_to_driver is off), and the clients' 503s name only the expert.
                    logger.warning(
                        "expert %s (%s) could not be loaded on %s: %s; its requests get 503 "
                        "expert_unavailable for %g s, then the file is read again",
                        expert.expert_id, expert.path, actor, outcome.error, self._failure_ttl_s,
                    )
                self._failures[key] = (outcome.error, now + self._failure_ttl_s)
                retry_after_s = self._failure_ttl_s
            results[index] = GroupResult(
                expert_id=outcome.expert_id,
                outputs=_to_tensor(outcome.outputs),
                hit=outcome.hit,
                load_ms=outcome.load_ms,
                compute_ms=outcome.compute_ms,
                expert_bytes=outcome.expert_bytes,
                activation_bytes=outcome.activation_bytes,
                actor=reply.actor,
                device_bytes=reply.device_bytes,
                error=outcome.error,
                error_kind=outcome.error_kind,
                key=outcome.key,
                generator_bytes=outcome.generator_bytes,
                retry_after_s=retry_after_s,
            )

    def _actor_lost(self, actor: str, reason: str) -> None:
        """`actor`'s process is gone (its socket dropped): dead from now, not from the next
        call to it, so that the dispatcher and /readyz know while no request is in flight."""
        if self._closed or not self._dispatcher.alive(actor):
            return
        logger.warning("actor %s dropped its connection (%s)", actor, reason)
        self._actor_died(actor)

    def _actor_died(self, actor: str) -> None:
        """A process of `actor` is known dead: no calls to it until its restart answers."""
        self._deaths[actor] += 1
        self._counts_before[actor] = _added(
            self._counts_before.get(actor, _NONE), self._counts.pop(actor, _NONE)
        )
        self._dispatcher.mark_dead(actor)
        self._revivals.watch(actor)

    async def _runtime_problem(self) -> str | None:
        """Why the runtime the actors live in does not answer now, or None when it does (or
        when this pool cannot tell: the default)."""
        return None

    def _runtime_lost(self, problem: str) -> None:
        """The runtime does not answer (a subclass found out): see `Revivals.runtime_lost`."""
        self._revivals.runtime_lost(problem)

    async def wait_until_alive(self, actor: str) -> bool:
        """Wait for a pending revival of `actor` to finish; True if it is alive."""
        return await self._revivals.wait_until_alive(actor)

    async def prefetch(self, experts: Sequence[ExpertRef]) -> None:
        """Ask the actor each expert's rows will go to to start loading it, where that actor
        does not hold it yet; returns without waiting."""
        if self._closed:
            return
        now = self._clock.now()
        by_actor: dict[str, list[ExpertRef]] = {}
        for ref in dict.fromkeys(experts):
            failed = self._failures.get(ref.sha256)
            if failed is not None and failed[1] > now:
                continue
            # Held by the actor its rows go to: nothing to do. Held only by one whose copy
            # rows no longer use (a restarted home reclaims its experts): load it at home.
            target = self._dispatcher.load_target(ref.sha256)
            if target is not None:
                by_actor.setdefault(target, []).append(ref)
        for actor, refs in by_actor.items():
            self._spawn(self._prefetch_on(actor, refs))

    async def _prefetch_on(self, actor: str, experts: list[ExpertRef]) -> None:
        try:
            resident = await self._call_prefetch(actor, experts)
        except ActorDied:
            return  # the next run on that actor notices and retries
        self._dispatcher.update_residency(actor, resident)

    async def forget_popularity(self) -> None:
        """Every live actor's cache counts popularity afresh; a dead one starts afresh anyway."""
        if self._closed:
            return
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
            infos.append(
                ActorInfo(
                    name=name,
                    device=self._device,
                    resident_bytes=sum(resident.values()),
                    budget_bytes=self._budget_bytes,
                    resident=sorted(str(key) for key in resident),
                    alive=self._dispatcher.alive(name),
                    counts=_added(
                        self._counts_before.get(name, _NONE), self._counts.get(name, _NONE)
                    ),
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
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._shutdown()

    @abstractmethod
    async def _shutdown(self) -> None:
        """Release the actors."""


def _failed(
    expert_id: int, reason: str, kind: str, *, actor: str, retry_after_s: float | None = None
) -> GroupResult:
    return GroupResult(
        expert_id=expert_id,
        outputs=_EMPTY,
        hit=False,
        load_ms=0.0,
        compute_ms=0.0,
        expert_bytes=0,
        activation_bytes=0,
        actor=actor,
        error=reason,
        error_kind=kind,
        retry_after_s=retry_after_s,
    )
