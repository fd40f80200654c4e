"""Each actor's cache counters over the pool's life, across restarts of its process.

An actor's reply carries its process's counters since that process started; a restarted
process counts from 0. The counts of the processes that died are kept and the current
process's added to them, so that an actor's counters only grow: a scrape after a restarted
process's first reply would otherwise see no reset once it had loaded as much again. Beside
them, how many of its processes ended, by cause.
"""

from __future__ import annotations

from server.pool._types import CacheCounts

__all__ = ["ActorCounts"]

_NONE = CacheCounts()


def _added(a: CacheCounts, b: CacheCounts) -> CacheCounts:
    return CacheCounts(
        evictions=a.evictions + b.evictions, loads=a.loads + b.loads,
        load_bytes=a.load_bytes + b.load_bytes,
    )


class ActorCounts:
    """Actor -> its counters: its current process's latest, plus its dead processes'."""

    def __init__(self) -> None:
        self._current: dict[str, CacheCounts] = {}
        self._before: dict[str, CacheCounts] = {}
        self._failures: dict[str, dict[str, int]] = {}

    def replied(self, actor: str, counts: CacheCounts) -> None:
        """`counts` came in a reply of `actor`'s current process."""
        current = self._current.get(actor)
        if current is not None and (
            counts.loads < current.loads
            or counts.evictions < current.evictions
            or counts.load_bytes < current.load_bytes
        ):
            # A process's counters never fall: this is a new process whose predecessor's
            # end the pool did not see as a death (the Ray cluster lost and back: every
            # actor was marked dead without its counts kept). Kept now, as at a death.
            self._before[actor] = _added(self._before.get(actor, _NONE), current)
        self._current[actor] = counts

    def died(self, actor: str, *, hung: bool = False) -> None:
        """`actor`'s current process is dead (or `hung`, and killed): its counts are kept,
        the next one's added."""
        causes = self._failures.setdefault(actor, {"died": 0, "hung": 0})
        causes["hung" if hung else "died"] += 1
        self._before[actor] = _added(
            self._before.get(actor, _NONE), self._current.pop(actor, _NONE)
        )

    def total(self, actor: str) -> CacheCounts:
        return _added(self._before.get(actor, _NONE), self._current.get(actor, _NONE))

    def failures(self, actor: str) -> dict[str, int]:
        """How many of `actor`'s processes ended, by cause ("died", "hung")."""
        return dict(self._failures.get(actor, {"died": 0, "hung": 0}))
