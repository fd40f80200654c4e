from __future__ import annotations

import pytest

from experts_store import Pacer, no_pace

pytestmark = pytest.mark.unit


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_pacer_rests_once_each_slice_of_work_has_passed() -> None:
    t = FakeTime()
    pacer = Pacer(0.002, 0.001, clock=t.clock, sleep=t.sleep)
    rested_at = []
    for call in range(1, 13):
        t.now += 0.0005  # each item takes 0.5 ms
        before = pacer.rests
        pacer()
        if pacer.rests > before:
            rested_at.append(call)
    # 2 ms of work is four items; the rest itself does not count as work.
    assert rested_at == [4, 8, 12]
    assert t.slept == [0.001, 0.001, 0.001]


def test_a_pacer_that_never_reaches_its_slice_never_rests() -> None:
    t = FakeTime()
    pacer = Pacer(1.0, 0.5, clock=t.clock, sleep=t.sleep)
    for _ in range(1000):
        t.now += 0.0001
        pacer()
    assert t.slept == [] and pacer.rests == 0


@pytest.mark.parametrize(("work", "rest"), [(0.0, 0.001), (-1.0, 0.0), (0.001, -0.1)])
def test_a_pacer_refuses_a_slice_it_cannot_keep(work: float, rest: float) -> None:
    with pytest.raises(ValueError, match="work_s"):
        Pacer(work, rest)


def test_no_pace_does_nothing() -> None:
    assert no_pace() is None
