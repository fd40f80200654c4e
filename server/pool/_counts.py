"""Each actor's cache counters over the pool's life, across restarts of its process.

An actor's reply carries its process's counters since that process started, and names that
process; a restarted process counts from 0. The counts of the processes that ended are kept
and the current process's added to them, so that an actor's counters only grow: a scrape
after a restarted process's first reply would otherwise see no reset once it had loaded as
much again. Beside them, how many of its processes ended, by cause.
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


def _less(a: CacheCounts, b: CacheCounts) -> CacheCounts:
    return CacheCounts(
        evictions=a.evictions - b.evictions, loads=a.loads - b.loads,
        load_bytes=a.load_bytes - b.load_bytes,
    )


def _latest(a: CacheCounts, b: CacheCounts) -> CacheCounts:
    # One process's counters only grow: of two of its readings, field by field the larger
    # is the later. Most often `b` is the later whole (once per reply: no new object then).
    if b.loads >= a.loads and b.evictions >= a.evictions and b.load_bytes >= a.load_bytes:
        return b
    return CacheCounts(
        evictions=max(a.evictions, b.evictions), loads=max(a.loads, b.loads),
        load_bytes=max(a.load_bytes, b.load_bytes),
    )


class ActorCounts:
    """Actor -> its counters: its current process's latest, plus its ended processes'."""

    def __init__(self) -> None:
        # Actor -> (its process that answered last, that process's latest counts).
        self._current: dict[str, tuple[str, CacheCounts]] = {}
        self._before: dict[str, CacheCounts] = {}
        # Actor -> (the process its last death was taken for, the counts kept then).
        self._dead: dict[str, tuple[str, CacheCounts]] = {}
        self._failures: dict[str, dict[str, int]] = {}

    def replied(self, actor: str, counts: CacheCounts, process: str) -> None:
        """`counts` came in a reply of `actor`'s process `process`."""
        known = self._current.get(actor)
        if known is None:
            dead = self._dead.pop(actor, None)
            if dead is not None and dead[0] == process:
                # The process taken for dead answers (a dropped socket or a failed call that
                # was not its end, a hung process whose kill did not land): the counts kept
                # at that "death" come back in its replies, so they are taken back.
                self._before[actor] = _less(self._before[actor], dead[1])
                known = dead
        elif known[0] != process:
            # Another process: its predecessor's end went unseen (an idle actor that Ray
            # restarted, with no socket to tell; the Ray cluster lost and back). Its counts
            # are kept now, as at a death.
            self._before[actor] = _added(self._before.get(actor, _NONE), known[1])
            known = None
        if known is not None:
            # The same process: replies may be handled out of the order in which their
            # counts were read (calls overlap; Ray returns a large reply through its object
            # store, a small one inline), and an older reading must not lower the counts.
            counts = _latest(known[1], counts)
        self._current[actor] = (process, counts)

    def died(self, actor: str, *, hung: bool = False) -> None:
        """`actor`'s current process is dead (or `hung`, and killed): its counts are kept,
        the next one's added."""
        causes = self._failures.setdefault(actor, {"died": 0, "hung": 0})
        causes["hung" if hung else "died"] += 1
        current = self._current.pop(actor, None)
        if current is not None:
            self._before[actor] = _added(self._before.get(actor, _NONE), current[1])
            self._dead[actor] = current

    def total(self, actor: str) -> CacheCounts:
        current = self._current.get(actor)
        return _added(self._before.get(actor, _NONE), _NONE if current is None else current[1])

    def failures(self, actor: str) -> dict[str, int]:
        """How many of `actor`'s processes ended, by cause ("died", "hung")."""
        return dict(self._failures.get(actor, {"died": 0, "hung": 0}))
