"""Which actor runs which expert: residency first, then rendezvous hashing balanced over each
call's loads, spilling hot experts.

The dispatcher is pure bookkeeping (no Ray, no asyncio), so both pools share it and it is
tested on its own. It keeps three things per actor: whether it is alive, the rows dispatched
to it and not yet answered, and the experts its last reply said were resident. Experts are
named by their cache keys (content hashes when served), which it treats as opaque.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["LOAD_WORK", "Dispatcher", "rendezvous_rank"]

logger = logging.getLogger(__name__)

# What a group that must load its expert weighs against one whose expert is resident when a
# call's loads are balanced: on CPU, loading a small expert from the page cache (read and
# checksum) costs about two of its forwards (benchmarks/RESULTS.md, "balanced loads").
LOAD_WORK = 2


# Every batch ranks each of its experts over the actors again (~90 blake2b per batch on the
# issue-19 load); a score never changes, and 32k of them are a few MB.
@functools.lru_cache(maxsize=1 << 15)
def _score(key: Hashable, actor: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{actor}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_rank(key: Hashable, actors: Iterable[str]) -> list[str]:
    """Actors ordered by highest-random-weight for this expert; the first is its home.

    Removing an actor only moves the experts whose home it was, so the caches of the other
    actors stay warm when one dies.
    """
    return sorted(actors, key=lambda actor: (-_score(key, actor), actor))


class Dispatcher:
    """Residency table, per-actor queue depth and the placement policy.

    Placement of one call's groups (`place`), each one expert's rows:
    1. an expert some actor holds (per its last reply) goes to its least queued holder;
    2. an expert no actor holds must be loaded: it goes to its home actor by rendezvous
       hashing over the live actors, or to its second rendezvous choice when that one has
       less of this call's work (a held group counts 1, a load `LOAD_WORK`). A call's groups
       run in parallel on their actors and the call ends with the slowest, so its loads, the
       part that may go either way, even the actors out; an unheld expert still goes to one
       of its first two choices, so the caches stay partitioned;
    3. if the chosen actor has more than `spill_queue_rows` rows queued, the expert spills to
       its next rendezvous choice when that one is less loaded.
    """

    def __init__(self, actors: Sequence[str], *, spill_queue_rows: int) -> None:
        if not actors:
            raise ValueError("a pool needs at least one actor")
        self._names = list(actors)
        self._spill_queue_rows = spill_queue_rows
        self._lock = threading.Lock()
        self._alive = dict.fromkeys(self._names, True)
        self._queued = dict.fromkeys(self._names, 0)
        self._resident: dict[str, dict[Hashable, int]] = {name: {} for name in self._names}

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def alive(self, actor: str) -> bool:
        with self._lock:
            return self._alive[actor]

    def live_actors(self) -> list[str]:
        with self._lock:
            return [name for name in self._names if self._alive[name]]

    def queued_rows(self, actor: str) -> int:
        with self._lock:
            return self._queued[actor]

    def home(self, key: Hashable, *, exclude: Iterable[str] = ()) -> str | None:
        """The expert's home among live actors not in `exclude` (None if there is none)."""
        with self._lock:
            return self._home_locked(key, set(exclude))

    def _home_locked(self, key: Hashable, exclude: set[str]) -> str | None:
        candidates = [n for n in self._names if self._alive[n] and n not in exclude]
        if not candidates:
            return None
        return rendezvous_rank(key, candidates)[0]

    def place(
        self, expert_rows: Sequence[tuple[Hashable, int]], *, exclude: Iterable[str] = ()
    ) -> list[str | None]:
        """Choose an actor for each (key, rows) of one call and count the rows as queued there.

        Returns one actor name per entry (None when no live actor is left). Callers must call
        `complete(actor, rows)` once the actor answered (or failed).
        """
        excluded = set(exclude)
        chosen: list[str | None] = [None] * len(expert_rows)
        with self._lock:
            live = [n for n in self._names if self._alive[n] and n not in excluded]
            if not live:
                return chosen
            work = dict.fromkeys(live, 0)
            loads: list[int] = []
            for index, (key, rows) in enumerate(expert_rows):
                holders = [n for n in live if key in self._resident[n]]
                if not holders:
                    loads.append(index)  # placed once the held groups' actors are known
                    continue
                ranked = rendezvous_rank(key, live)
                holder = min(holders, key=lambda n: (self._queued[n], ranked.index(n)))
                chosen[index] = self._settle(key, holder, ranked, rows, work, 1)
            for index in loads:
                key, rows = expert_rows[index]
                ranked = rendezvous_rank(key, live)
                actor = ranked[0]
                if len(ranked) > 1 and work[ranked[1]] < work[actor]:
                    actor = ranked[1]
                chosen[index] = self._settle(key, actor, ranked, rows, work, LOAD_WORK)
        return chosen

    def _settle(
        self,
        key: Hashable,
        actor: str,
        ranked: list[str],
        rows: int,
        work: dict[str, int],
        weight: int,
    ) -> str:
        """`actor`, or the expert's next choice when `actor` is saturated; counts the group."""
        if self._queued[actor] > self._spill_queue_rows:
            # The expert is hot and its actor saturated: a second copy on the next rendezvous
            # choice keeps spills of one expert on one other actor instead of all of them.
            others = [n for n in ranked if n != actor]
            if others and self._queued[others[0]] < self._queued[actor]:
                logger.debug("expert %s spills from %s to %s", key, actor, others[0])
                actor = others[0]
        self._queued[actor] += rows
        work[actor] += weight
        return actor

    def complete(self, actor: str, rows: int) -> None:
        with self._lock:
            self._queued[actor] = max(0, self._queued[actor] - rows)

    def update_residency(self, actor: str, resident: Mapping[Any, int]) -> None:
        """Replace what `actor` holds with what its latest reply reported."""
        with self._lock:
            self._resident[actor] = dict(resident)

    def mark_dead(self, actor: str) -> None:
        """The actor died: whatever it held is gone, and nothing goes there until it is back."""
        with self._lock:
            self._alive[actor] = False
            self._resident[actor] = {}
        logger.warning("actor %s marked dead", actor)

    def mark_alive(self, actor: str) -> None:
        with self._lock:
            self._alive[actor] = True
            self._resident[actor] = {}

    def residency(self) -> dict[Hashable, list[str]]:
        """key -> actors holding it, as of their latest replies."""
        table: dict[Hashable, list[str]] = {}
        with self._lock:
            for name in self._names:
                if not self._alive[name]:
                    continue
                for key in self._resident[name]:
                    table.setdefault(key, []).append(name)
        return {key: sorted(names) for key, names in table.items()}

    def resident(self, actor: str) -> dict[Hashable, int]:
        with self._lock:
            return dict(self._resident[actor])
