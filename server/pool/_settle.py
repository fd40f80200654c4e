"""A failed `run`'s actor calls that still compute.

`DispatchingPool.run` raises a failure as it comes: waiting for the batch's other calls first
turned a 503 into a 504 behind a slow sibling. Those calls go on to their end, so a caller
that bounds the work in flight (the batcher's slots) has to know when they have ended: the
failure carries them, and `calls_settled(error)` waits for them.
"""

from __future__ import annotations

import asyncio

__all__ = ["calls_settled", "carry_calls"]

# Set on the error `run` raised: the run's calls (a list that retries still running may
# extend). An attribute of the error, so that it passes every wrapper of a pool unchanged.
_CALLS = "_momlp_run_calls"


def carry_calls(error: BaseException, calls: list[asyncio.Task[None]]) -> None:
    """Have `error`, raised by a run, carry that run's actor calls if some still run."""
    if any(not call.done() for call in calls):
        setattr(error, _CALLS, calls)


async def calls_settled(error: BaseException) -> None:
    """Return once every actor call of the `ExpertPool.run` that raised `error` has ended,
    retries included; at once for an error that carries none (raised after its calls ended,
    or not by a pool). Waiting does not cancel them."""
    # Taken off the error as it is read: the error lives on in its requests' answers and
    # logs and should not carry the tasks into a pickle of its state, and a second wait on
    # the same error (none today) finds nothing rather than another run's calls.
    calls: list[asyncio.Task[None]] | None = vars(error).pop(_CALLS, None)
    if calls is None:
        return
    # A call still running may retry its groups on another actor, adding calls to the list
    # before it ends: looked at again until none is left running.
    while pending := [call for call in calls if not call.done()]:
        await asyncio.wait(pending)
