"""The pool's memory of expert files that could not be loaded.

Keyed by content hash, so that a bad file is not read again for `ttl_s` seconds (its
requests get 503 at once, with Retry-After), while a republished fix, which has another
hash, is tried at once; and it carries over from one store version to the next. Entries past
their time are dropped, so the memory holds about the files that failed within `ttl_s`, not
every bad file a long-running server ever met.
"""

from __future__ import annotations

import logging

from experts_store import ExpertRef

__all__ = ["LoadFailures"]

logger = logging.getLogger(__name__)

# The fewest entries at which a note looks for expired ones to drop.
_PRUNE_FROM = 64


class LoadFailures:
    """Content hash -> (reason, until when, on the pool's clock)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._until: dict[str, tuple[str, float]] = {}
        # Expired entries are dropped once the map reaches this size, which then becomes
        # twice what is left: each entry is looked at O(1) times on average, and the map
        # stays within twice the files remembered (plus _PRUNE_FROM).
        self._prune_at = _PRUNE_FROM

    def __len__(self) -> int:
        """Entries held: the files remembered now, and expired ones not yet dropped."""
        return len(self._until)

    def remembered(self, key: str, now: float) -> tuple[str, float] | None:
        """(reason, seconds until the file is read again) while `key` is remembered."""
        entry = self._until.get(key)
        if entry is None:
            return None
        if entry[1] <= now:
            # Its time is up: the file is read again on this request.
            self._until.pop(key, None)
            return None
        return entry[0], entry[1] - now

    def note(self, expert: ExpertRef, actor: str, reason: str, now: float) -> float:
        """Remember that `expert` failed to load on `actor`; returns the seconds until its
        file is read again."""
        key = expert.sha256
        if self.remembered(key, now) is None:
            # Once per file and memory: the actor logs it too, but on its own node
            # (log_to_driver is off), and the clients' 503s name only the expert.
            logger.warning(
                "expert %s (%s) could not be loaded on %s: %s; its requests get 503 "
                "expert_unavailable for %g s, then the file is read again",
                expert.expert_id, expert.path, actor, reason, self.ttl_s,
            )
        self._until[key] = (reason, now + self.ttl_s)
        if len(self._until) >= self._prune_at:
            self._until = {k: v for k, v in self._until.items() if v[1] > now}
            self._prune_at = max(_PRUNE_FROM, 2 * len(self._until))
        return self.ttl_s
