"""What one `run` may still spend on retrying the groups of its failed actor calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from server._exceptions import ActorFailed

__all__ = ["MAX_RETRIES", "Retries"]

# Retries of a dead actor's groups: one covers a single death, the second two deaths close
# together (the retry's actor dying too). Each attempt that died produced no answer.
MAX_RETRIES = 2


def _always() -> bool:
    # A run given no `wanted` (benchmarks, tests, a pool used without a batcher) retries
    # every death, as before the check.
    return True


@dataclass(frozen=True)
class Retries:
    """A run's retry budgets, passed down each chain of retries.

    `deaths`: failures that were news about their actor (it died, or hung and was killed);
    `stale`: failures of an actor's previous process whose death was already noticed, on a
    budget of their own so that they do not use up a retry that a next death may need (it
    still ends a chase of an actor that keeps dying); `suspects`: calls given up, their actor
    alive, because it stopped answering its health checks (`_health`), on a budget of their
    own too, so that a retry on a suspect (every live actor is one) waits for its answer or
    its kill rather than hopping for good; `exclude`: actors the next placement
    avoids (those that failed this run); `wanted`: whether a caller still waits for the run's
    answers. A hang is found at `actor_call_timeout_s`, after every request of its batch has
    had its 504 (`request_timeout_s` is below it by default): a retry then computes rows no one
    reads, and where the rows themselves hang (a file on a hung mount), it hangs and kills
    again, twice more, each time holding the batch's in-flight slot for the whole deadline.
    """

    deaths: int = MAX_RETRIES
    stale: int = MAX_RETRIES
    suspects: int = MAX_RETRIES
    exclude: frozenset[str] = frozenset()
    wanted: Callable[[], bool] = field(default=_always, compare=False)

    def after_death(self, actor: str, *, hung: bool = False) -> Retries:
        """The budget left to retry the groups of a call whose `actor` died (or `hung`);
        `ActorFailed` when it is spent or no caller waits any more."""
        what = "hung" if hung else "died"
        if self.deaths <= 0:
            raise ActorFailed(actor=actor, reason=f"{what} again during the retries")
        self.check_wanted(actor, what)
        return dataclasses.replace(self, deaths=self.deaths - 1, exclude=self.exclude | {actor})

    def after_stale(self, actor: str, *, hung: bool = False) -> Retries:
        """The budget left to retry the groups of a call to `actor`'s previous process, which
        died (or `hung`: the call outlived its deadline); `ActorFailed` when it is spent or no
        caller waits any more."""
        # A hung call's error said "died": an operator looked for a crash that never was.
        what = "hung" if hung else "died"
        if self.stale <= 0:
            raise ActorFailed(actor=actor, reason=f"{what} again during the retries")
        self.check_wanted(actor, what)
        return dataclasses.replace(self, stale=self.stale - 1)

    def after_suspect(self, actor: str) -> Retries:
        """The budget left to retry the groups of a call given up because `actor` stopped
        answering; `ActorFailed` when no caller waits any more."""
        self.check_wanted(actor, "stopped answering")
        return dataclasses.replace(
            self, suspects=self.suspects - 1, exclude=self.exclude | {actor}
        )

    def check_wanted(self, actor: str, what: str) -> None:
        """`ActorFailed` when no caller waits any more for the groups `actor` failed."""
        if not self.wanted():
            raise ActorFailed(
                actor=actor, reason=f"{what} mid-call; not retried: no request waits for it"
            )

    def anywhere(self) -> Retries:
        """The same budgets, avoiding no actor: every live one had failed this run, and one
        that answers again (Ray restarted it, or a suspect answered) is fine again."""
        return dataclasses.replace(self, exclude=frozenset())
