"""`Deadline`: one fixed timeout that many concurrent requests share, at the cost of one timer.

`asyncio.timeout` arms and disarms a loop timer for every scope, ~4 µs a scope on the 2-core
VM, and a predict passes two (its body's arrival, its answer's). Scopes of one fixed length
end their time in the order they began, so the oldest open scope always holds the earliest
deadline: one timer armed for it serves them all. A scope that ends in time only leaves the
queue; the timer, when it fires, cancels the scopes past their time and re-arms itself for
the oldest left (about once per `timeout_s` while traffic runs, not once per request).

An expired scope behaves as `asyncio.timeout`'s does: its task is cancelled, and the
cancellation leaves the scope as `TimeoutError`. A scope whose client has gone (`client_gone`,
called by the connection when it is lost) ends the same way, as starlette's
`ClientDisconnect`: uvicorn does not stop a request's handler when its client hangs up, so a
request still queued was computed for no one, and a dead actor's rows retried for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from starlette.requests import ClientDisconnect

from server._settings import Settings

__all__ = ["WAITING", "Deadline", "DeadlineScope", "Deadlines", "client_gone"]

# The ASGI scope's key for the `DeadlineScope` its request's answer is awaited in, while it is.
WAITING = "momlp.waiting"

# A loop may run a timer a little before its time (uvloop rounds to whole milliseconds); a
# scope this close to its deadline is expired then, rather than the timer re-armed for it.
_EARLY_S = 0.001


class Deadline:
    """`async with deadline.scope():` raises `TimeoutError` once `timeout_s` has passed."""

    __slots__ = ("timeout_s", "_queues")

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        # One queue per event loop: an app may be driven by several loops in turn (tests).
        self._queues: dict[asyncio.AbstractEventLoop, _Queue] = {}

    def scope(self, asgi_scope: MutableMapping[str, Any] | None = None) -> DeadlineScope:
        """A scope; with `asgi_scope`, one its connection's loss ends (`client_gone`)."""
        return DeadlineScope(self, asgi_scope)

    def _queue(self) -> _Queue:
        loop = asyncio.get_running_loop()
        queue = self._queues.get(loop)
        if queue is None:
            # A closed loop's queue is dropped here; it holds no scope (its tasks have ended).
            self._queues = {k: q for k, q in self._queues.items() if not k.is_closed()}
            queue = self._queues[loop] = _Queue(loop, self.timeout_s)
        return queue


class DeadlineScope:
    """One use of a `Deadline`; enter it once."""

    __slots__ = ("_deadline", "_asgi", "_queue", "_task", "_cancelling", "expired", "gone")

    def __init__(
        self, deadline: Deadline, asgi_scope: MutableMapping[str, Any] | None = None
    ) -> None:
        self._deadline = deadline
        self._asgi = asgi_scope
        self._queue: _Queue | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.expired = False
        self.gone = False

    async def __aenter__(self) -> DeadlineScope:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Deadline scope must be entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._queue = self._deadline._queue()
        self._queue.add(self)
        if self._asgi is not None:
            self._asgi[WAITING] = self
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._queue is not None and self._task is not None
        self._queue.remove(self)
        if self._asgi is not None:
            # Past here a lost connection must not cancel the task: it is answering.
            self._asgi.pop(WAITING, None)
        # As `asyncio.timeout`: only our own cancellation becomes TimeoutError; one the
        # task received from elsewhere as well stays a cancellation.
        if (
            (self.expired or self.gone)
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            if self.gone:
                raise ClientDisconnect() from exc
            raise TimeoutError from exc

    def _expire(self) -> None:
        assert self._task is not None
        if self.gone:
            return  # cancelled already, for its client
        self.expired = True
        self._task.cancel()

    def client_gone(self) -> None:
        """The client hung up while its answer is awaited: end the scope now."""
        if self._task is None or self.expired or self.gone:
            return
        self.gone = True
        self._task.cancel()


def client_gone(asgi_scope: Mapping[str, object]) -> None:
    """The connection of the request `asgi_scope` describes was lost: end the wait for its
    answer, if one is under way (a no-op otherwise)."""
    waiting = asgi_scope.get(WAITING)
    if isinstance(waiting, DeadlineScope):
        waiting.client_gone()


class _Queue:
    """The open scopes of one `Deadline` on one loop, oldest first (a dict keeps insertion
    order, and removes any scope in O(1) when it ends in time)."""

    __slots__ = ("_loop", "_timeout_s", "_open", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._open: dict[DeadlineScope, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, scope: DeadlineScope) -> None:
        at = self._loop.time() + self._timeout_s
        self._open[scope] = at
        if self._timer is None:
            self._timer = self._loop.call_at(at, self._fire)

    def remove(self, scope: DeadlineScope) -> None:
        self._open.pop(scope, None)

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self._open:
            scope, at = next(iter(self._open.items()))
            if at > now + _EARLY_S:
                self._timer = self._loop.call_at(at, self._fire)
                return
            del self._open[scope]
            scope._expire()


@dataclass(frozen=True, slots=True)
class Deadlines:
    """An app's two: for a request body to arrive (`body_timeout_s`, 408 past it) and for a
    request to be answered (`request_timeout_s`, 504 past it)."""

    body: Deadline
    answer: Deadline

    @classmethod
    def of(cls, settings: Settings) -> Deadlines:
        return cls(Deadline(settings.body_timeout_s), Deadline(settings.request_timeout_s))
