"""Which actor runs which expert: residency first, then rendezvous hashing, spilling hot experts.

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

__all__ = ["Dispatcher", "forget_scores", "rendezvous_rank"]

logger = logging.getLogger(__name__)


# Every batch ranks each of its experts over the actors again (~90 blake2b per batch on the
# issue-19 load); a score never changes, and 32k of them are a few MB.
@functools.lru_cache(maxsize=1 << 15)
def _score(key: Hashable, actor: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{actor}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def forget_scores() -> None:
    """Drop every cached score: a new store version went live. The old version's changed
    experts are never ranked again, and each swap added their keys until the cache was full
    (~10 MB; `benchmarks/server_memory.py`); the live ones are scored again in a few batches."""
    _score.cache_clear()


def rendezvous_rank(key: Hashable, actors: Iterable[str]) -> list[str]:
    """Actors ordered by highest-random-weight for this expert; the first is its home.

    Removing an actor only moves the experts whose home it was, so the caches of the other
    actors stay warm when one dies.
    """
    return sorted(actors, key=lambda actor: (-_score(key, actor), actor))


class Dispatcher:
    """Residency table, per-actor queue depth and the placement policy.

    Placement of one expert's rows:
    1. actors already holding the expert (per their last reply), least queued first; but an
       expert whose home actor has come back from a restart goes home until the home holds it
       again (while it was dead, the others took its experts over and would keep them all);
    2. otherwise the expert's home actor by rendezvous hashing over the live actors;
    3. if the chosen actor has more than `spill_queue_rows` rows queued, the expert spills to
       its second rendezvous choice when that one is less loaded.
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
        # Actors revived after a death: their experts are reclaimed from the other holders.
        self._revived: set[str] = set()

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
        """Choose an actor for each (key, rows) and count the rows as queued there.

        Returns one actor name per entry (None when no live actor is left). Callers must call
        `complete(actor, rows)` once the actor answered (or failed).
        """
        excluded = set(exclude)
        chosen: list[str | None] = []
        with self._lock:
            live = [n for n in self._names if self._alive[n] and n not in excluded]
            for key, rows in expert_rows:
                actor = self._choose_locked(key, live)
                if actor is not None:
                    self._queued[actor] += rows
                chosen.append(actor)
        return chosen

    def load_target(self, key: Hashable) -> str | None:
        """The actor that rows for `key` would go to now if it does not hold `key` yet (where
        loading it ahead pays), else None (held there already, or no actor alive)."""
        with self._lock:
            live = [n for n in self._names if self._alive[n]]
            if not live:
                return None
            ranked = rendezvous_rank(key, live)
            return None if self._holders_locked(key, live, ranked) else ranked[0]

    def _holders_locked(self, key: Hashable, live: list[str], ranked: list[str]) -> list[str]:
        """The live actors rows for `key` may go to because they hold it."""
        holders = [n for n in live if key in self._resident[n]]
        if holders and ranked[0] in self._revived and ranked[0] not in holders:
            return []  # reclaimed by its home; the other copies age out of their caches
        return holders

    def _choose_locked(self, key: Hashable, live: list[str]) -> str | None:
        if not live:
            return None
        ranked = rendezvous_rank(key, live)
        holders = self._holders_locked(key, live, ranked)
        if holders:
            actor = min(holders, key=lambda n: (self._queued[n], ranked.index(n)))
        else:
            actor = ranked[0]
        if self._queued[actor] > self._spill_queue_rows:
            # The expert is hot and its actor saturated: a second copy on the next rendezvous
            # choice keeps spills of one expert on one other actor instead of all of them.
            others = [n for n in ranked if n != actor]
            if others and self._queued[others[0]] < self._queued[actor]:
                logger.debug("expert %s spills from %s to %s", key, actor, others[0])
                actor = others[0]
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
            was_alive, self._alive[actor] = self._alive[actor], False
            self._resident[actor] = {}
        if was_alive:
            logger.warning("actor %s marked dead", actor)

    def mark_alive(self, actor: str) -> None:
        """The actor is back (a new process, its cache empty): its experts go home again."""
        with self._lock:
            self._alive[actor] = True
            self._resident[actor] = {}
            self._revived.add(actor)

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
