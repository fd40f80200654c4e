"""Whether a store version's experts fit the actors' caches."""

from __future__ import annotations

from collections.abc import Iterable

from experts_store import ExpertRef, ExpertTooLarge

__all__ = ["check_budget"]


def check_budget(experts: Iterable[ExpertRef], budget_bytes: int) -> None:
    """Refuse a store version in which some expert can never fit in one actor's cache."""
    for ref in experts:
        if ref.nbytes > budget_bytes:
            raise ExpertTooLarge(
                expert_id=ref.expert_id, nbytes=ref.nbytes, budget_bytes=budget_bytes
            )
