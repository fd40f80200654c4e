"""`Suspects`: actors that stopped answering their health checks, and the calls they hold.

A stopped actor is killed only after `unresponsive_s` without an answer (`_health`), lest a
slow one be restarted for nothing; meanwhile every batch with rows on it waited, holding its
in-flight slot, so the whole server stalled. A suspect's calls are given up at once (their
deadlines moved to now, so a late reply is never read) and their groups run elsewhere, and
new groups avoid it, while it stays alive for its cache and for `/readyz`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Suspects", "TrackedCall"]


@dataclass(eq=False)
class TrackedCall:
    """A run call in flight since `started`: `given_up` once its actor became a suspect."""

    deadline: asyncio.Timeout
    may_give_up: bool
    started: float
    given_up: bool = False


class Suspects:
    """The pool's suspect actors and the run calls in flight on every actor (one event loop)."""

    def __init__(self) -> None:
        self._actors: set[str] = set()
        self._calls: dict[str, set[TrackedCall]] = {}
        # Actor -> (times it became a suspect, calls of its given up), over the pool's life:
        # only a WARNING line told an operator, and a given-up call's rows are computed twice.
        self._counts: dict[str, tuple[int, int]] = {}
        # Runs waiting for an actor to take their groups, woken when a suspect answers again.
        self._waiting: list[asyncio.Future[None]] = []

    def __bool__(self) -> bool:
        return bool(self._actors)

    def __contains__(self, actor: object) -> bool:
        return actor in self._actors

    def track(
        self, actor: str, deadline: asyncio.Timeout, *, may_give_up: bool, now: float
    ) -> TrackedCall:
        """Record a call to `actor` made at `now` under `deadline` (entered before the next
        await)."""
        call = TrackedCall(deadline, may_give_up, now)
        self._calls.setdefault(actor, set()).add(call)
        return call

    def done(self, actor: str, call: TrackedCall) -> None:
        self._calls[actor].discard(call)

    def holds_call_since(self, actor: str, before: float) -> bool:
        """Whether `actor` holds a call made before `before`."""
        return any(call.started < before for call in self._calls.get(actor, ()))

    def suspect(self, actor: str, live: Iterable[str]) -> int:
        """Make `actor` a suspect and give up its calls in flight, where one of the `live`
        actors is no suspect to take them (else they would only come back to it); how many
        were given up."""
        if actor not in self._actors:
            self._actors.add(actor)
            self._count(actor, 1, 0)
        if all(other in self._actors for other in live):
            return 0
        given_up = 0
        for call in self._calls.get(actor, ()):
            if call.given_up or not call.may_give_up or call.deadline.expired():
                continue
            with contextlib.suppress(RuntimeError):  # its call ended in this very turn
                call.deadline.reschedule(asyncio.get_running_loop().time())
                call.given_up = True
                given_up += 1
        self._count(actor, 0, given_up)
        return given_up

    def _count(self, actor: str, suspicions: int, given_up: int) -> None:
        before = self._counts.get(actor, (0, 0))
        self._counts[actor] = (before[0] + suspicions, before[1] + given_up)

    def counts(self, actor: str) -> tuple[int, int]:
        """How many times `actor` became a suspect, and how many of its calls were given up."""
        return self._counts.get(actor, (0, 0))

    def clear(self, actor: str) -> bool:
        """`actor` died (its revival decides when it takes groups again): no suspect now; True
        if it was."""
        if actor in self._actors:
            self._actors.discard(actor)
            return True
        return False

    def answered(self, actor: str) -> bool:
        """`actor` answered a probe or a call: no suspect now, and, if it was one (True), the
        runs waiting on `back` go on."""
        if not self.clear(actor):
            return False
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)
        self._waiting.clear()
        return True

    def back(self) -> asyncio.Future[None]:
        """Done when a suspect next answers again (cancel it once no longer waited for)."""
        self._waiting = [waiter for waiter in self._waiting if not waiter.done()]
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        return waiter

    def avoid(self, exclude: frozenset[str], live: Iterable[str]) -> frozenset[str]:
        """`exclude` and the suspects, unless that would leave no live actor to place on."""
        wider = exclude | self._actors
        return wider if any(actor not in wider for actor in live) else exclude
