"""Which actor a prefetch asks to load which experts."""

from __future__ import annotations

from collections.abc import Sequence

from experts_store import ExpertRef
from server.pool._dispatch import Dispatcher
from server.pool._failures import LoadFailures

__all__ = ["prefetch_plan"]


def prefetch_plan(
    experts: Sequence[ExpertRef], dispatcher: Dispatcher, failures: LoadFailures, now: float
) -> dict[str, list[ExpertRef]]:
    """Actor -> the experts it should start loading: each expert once, at the actor its rows
    will go to, where that actor does not hold it yet and it is not remembered as failed."""
    by_actor: dict[str, list[ExpertRef]] = {}
    for ref in dict.fromkeys(experts):
        if failures.remembered(ref.sha256, now) is not None:
            continue
        # Held by the actor its rows go to: nothing to do. Held only by one whose copy
        # rows no longer use (a restarted home reclaims its experts): load it at home.
        target = dispatcher.load_target(ref.sha256)
        if target is not None:
            by_actor.setdefault(target, []).append(ref)
    return by_actor
