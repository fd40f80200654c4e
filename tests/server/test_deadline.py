"""`Deadline`: many requests' timeouts on one timer, behaving as `asyncio.timeout` does."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.requests import ClientDisconnect

from server.http._deadline import Deadline, client_gone

pytestmark = pytest.mark.unit


async def _within(deadline: Deadline, seconds: float) -> str:
    try:
        async with deadline.scope():
            await asyncio.sleep(seconds)
    except TimeoutError:
        return "timeout"
    return "done"


async def test_a_scope_past_its_time_raises_timeout_error_and_leaves_its_task_usable() -> None:
    deadline = Deadline(0.05)
    start = time.monotonic()
    assert await _within(deadline, 5.0) == "timeout"
    assert 0.04 <= time.monotonic() - start < 2.0
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.01)  # no cancellation left pending on the task


async def test_a_scope_ended_in_time_is_never_cancelled_later() -> None:
    deadline = Deadline(0.05)
    assert await _within(deadline, 0.0) == "done"
    # The timer armed for that scope fires while this task goes on; it must not touch it.
    await asyncio.sleep(0.15)


async def test_concurrent_scopes_each_time_out_by_their_own_start() -> None:
    deadline = Deadline(0.3)
    # Started in turn, some finishing at once, some never: only the slow ones time out, also
    # those begun after a fast one that ended first, and a late one begun past others' ends.
    sleeps = [0.0, 30.0, 0.0, 30.0, 30.0, 0.0, 0.0, 30.0]
    tasks = []
    for seconds in sleeps:
        tasks.append(asyncio.create_task(_within(deadline, seconds)))
        await asyncio.sleep(0.01)
    late = asyncio.create_task(_within(deadline, 0.5))
    start = time.monotonic()
    results = await asyncio.gather(*tasks, late)
    assert results == ["done" if s == 0.0 else "timeout" for s in sleeps] + ["timeout"]
    assert time.monotonic() - start < 5.0


async def test_a_scope_begun_after_the_timer_fired_still_times_out() -> None:
    deadline = Deadline(0.05)
    assert await _within(deadline, 0.0) == "done"
    await asyncio.sleep(0.1)  # the timer fired with nothing open
    assert await _within(deadline, 5.0) == "timeout"


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    deadline = Deadline(5.0)
    task = asyncio.create_task(_within(deadline, 5.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_lost_connection_ends_the_wait_as_client_disconnect_and_only_while_it_waits(
) -> None:
    deadline = Deadline(5.0)
    asgi: dict[str, object] = {}

    async def waits() -> None:
        async with deadline.scope(asgi):
            await asyncio.sleep(5.0)

    task = asyncio.create_task(waits())
    await asyncio.sleep(0.01)
    client_gone(asgi)
    with pytest.raises(ClientDisconnect):
        await asyncio.wait_for(task, 2.0)
    assert asgi == {}  # the scope unregistered itself
    # Once the wait is over (answered), a lost connection touches the task no more.
    async with deadline.scope(asgi):
        pass
    client_gone(asgi)
    await asyncio.sleep(0.01)  # no cancellation pending on this task
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


async def test_a_timeout_and_a_lost_connection_together_cancel_once() -> None:
    deadline = Deadline(0.02)
    asgi: dict[str, object] = {}
    outcome = ""
    try:
        async with deadline.scope(asgi):
            await asyncio.sleep(0.1)  # expires here
    except TimeoutError:
        outcome = "timeout"
    client_gone(asgi)  # after the timeout: nothing left to end
    await asyncio.sleep(0.01)
    assert outcome == "timeout"
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


def test_one_deadline_serves_several_event_loops_in_turn() -> None:
    deadline = Deadline(0.05)
    assert asyncio.run(_within(deadline, 5.0)) == "timeout"
    assert asyncio.run(_within(deadline, 0.0)) == "done"
    assert asyncio.run(_within(deadline, 5.0)) == "timeout"


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan")])
def test_a_deadline_must_be_positive(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Deadline(timeout_s)
