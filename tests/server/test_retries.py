"""A run's retry budgets: the error that ends a chain of retries names what its actor did."""

from __future__ import annotations

import pytest

from server import ActorFailed
from server.pool._retries import Retries


@pytest.mark.unit
@pytest.mark.parametrize(("hung", "what"), [(False, "died"), (True, "hung")])
def test_a_stale_call_spent_or_unwanted_is_named_by_what_its_process_did(
    hung: bool, what: str
) -> None:
    # A stale call that had hung was reported as "died": an operator looked for a crash.
    with pytest.raises(ActorFailed) as spent:
        Retries(stale=0).after_stale("actor-1", hung=hung)
    assert spent.value.fields == {"actor": "actor-1", "reason": f"{what} again during the retries"}
    with pytest.raises(ActorFailed) as unwanted:
        Retries(wanted=lambda: False).after_stale("actor-1", hung=hung)
    reason = f"{what} mid-call; not retried: no request waits for it"
    assert unwanted.value.fields["reason"] == reason


@pytest.mark.unit
def test_a_stale_call_with_budget_left_spends_one_stale_retry_and_keeps_its_actor() -> None:
    left = Retries().after_stale("actor-1", hung=True)
    assert (left.stale, left.deaths, left.exclude) == (Retries().stale - 1, Retries().deaths,
                                                        frozenset())
