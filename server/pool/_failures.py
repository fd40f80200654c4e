"""The pool's memory of expert files that could not be loaded.

Keyed by content hash, so that a bad file is not read again for `ttl_s` seconds (its
requests get 503 at once, with Retry-After), while a republished fix, which has another
hash, is tried at once; and it carries over from one store version to the next.
"""

from __future__ import annotations

import logging

from experts_store import ExpertRef

__all__ = ["LoadFailures"]

logger = logging.getLogger(__name__)


class LoadFailures:
    """Content hash -> (reason, until when, on the pool's clock)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._until: dict[str, tuple[str, float]] = {}

    def remembered(self, key: str, now: float) -> tuple[str, float] | None:
        """(reason, seconds until the file is read again) while `key` is remembered."""
        entry = self._until.get(key)
        if entry is None or entry[1] <= now:
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
        return self.ttl_s
