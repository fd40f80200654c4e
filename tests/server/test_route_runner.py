from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable

import pytest
import torch

from server.batching._route import RouteRunner

pytestmark = pytest.mark.unit


class CostlyRoute:
    """A route that 'spends' `t_per_call` plus `s_per_row` CPU seconds per row on a fake CPU
    clock and records the thread it ran on."""

    def __init__(self, s_per_row: float) -> None:
        self.s_per_row = s_per_row
        self.t_per_call = 0.0
        self.t = 0.0
        self.threads: list[int] = []

    def now(self) -> float:
        return self.t

    def __call__(self, x: torch.Tensor, options: Hashable) -> int:
        self.threads.append(threading.get_ident())
        self.t += self.t_per_call + self.s_per_row * int(x.shape[0])
        return int(x.shape[0])


async def test_a_cheap_batch_is_routed_on_the_event_loop_once_its_cost_is_known() -> None:
    route = CostlyRoute(s_per_row=10e-6)
    runner = RouteRunner(route, inline_s=0.5e-3, cpu_clock=route)
    loop_thread = threading.get_ident()

    assert await runner(torch.zeros(4, 2), None) == 4
    assert runner.estimate_s(4) == pytest.approx(40e-6)
    assert await runner(torch.zeros(8, 2), None) == 8

    # The first batch had no estimate yet, so it left the loop; the second cost ~80 µs.
    assert route.threads[0] != loop_thread
    assert route.threads[1] == loop_thread


async def test_a_batch_estimated_above_the_bound_goes_to_a_thread() -> None:
    route = CostlyRoute(s_per_row=10e-6)
    runner = RouteRunner(route, inline_s=0.5e-3, cpu_clock=route)
    loop_thread = threading.get_ident()
    await runner(torch.zeros(4, 2), None)  # 40 µs for 4 rows

    # A larger batch is scaled up in proportion: 50 rows are 0.5 ms, 51 are over it.
    assert runner.inline(50)
    assert not runner.inline(51)
    await runner(torch.zeros(51, 2), None)
    assert route.threads[1] != loop_thread


async def test_a_smaller_batch_is_not_estimated_cheaper_than_recent_ones() -> None:
    route = CostlyRoute(s_per_row=0.0)
    route.t_per_call = 0.3e-3  # a fixed cost per call, as routing a few rows has
    runner = RouteRunner(route, inline_s=0.5e-3, cpu_clock=route)
    await runner(torch.zeros(8, 2), None)

    assert runner.estimate_s(1) == pytest.approx(0.3e-3)
    assert runner.inline(8)
    assert not runner.inline(16)  # 0.6 ms if it grew with the rows


async def test_a_slow_first_batch_is_forgotten_as_cheap_ones_follow() -> None:
    route = CostlyRoute(s_per_row=1e-3)
    runner = RouteRunner(route, inline_s=0.5e-3, cpu_clock=route)
    loop_thread = threading.get_ident()
    await runner(torch.zeros(4, 2), None)
    route.s_per_row = 10e-6

    for _ in range(30):
        await runner(torch.zeros(4, 2), None)

    assert route.threads[1] != loop_thread  # still judged by the slow first batch
    assert route.threads[-1] == loop_thread


async def test_a_zero_bound_routes_every_batch_in_a_thread() -> None:
    route = CostlyRoute(s_per_row=0.0)
    runner = RouteRunner(route, inline_s=0.0, cpu_clock=route)
    loop_thread = threading.get_ident()

    for _ in range(3):
        await runner(torch.zeros(1, 2), None)

    assert loop_thread not in route.threads


async def test_a_slow_route_in_a_thread_leaves_the_event_loop_serving() -> None:
    release = threading.Event()

    def blocking_route(x: torch.Tensor, options: Hashable) -> str:
        assert release.wait(timeout=10.0), "the event loop was blocked by routing"
        return "routed"

    runner = RouteRunner(blocking_route, inline_s=0.5e-3)
    routing = asyncio.create_task(runner(torch.zeros(2, 2), None))
    await asyncio.sleep(0.01)
    release.set()  # runs only if the loop is free while the route waits

    assert await routing == "routed"
