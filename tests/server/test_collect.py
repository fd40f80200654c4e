from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator

import pytest

from server.serving._collect import collections_deferred, thaw

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    thaw()
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_no_collection_inside_and_the_collector_back_on_after() -> None:
    gc.enable()
    with collections_deferred(freeze_from=None):
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with collections_deferred(freeze_from=None):
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_callers_leave_it_off_until_the_last_is_out() -> None:
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collections_deferred(freeze_from=None):
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(5)
    with collections_deferred(freeze_from=None):
        pass
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    thread.join(5)
    assert gc.isenabled()


def test_freeze_sets_aside_what_is_alive_and_thaw_hands_it_back() -> None:
    thaw()
    kept = [[i] for i in range(1000)]
    # Another thread of the test process (one an earlier test left) that frees a frozen
    # object between the two counts takes it out of the permanent generation: the second
    # count came out 2 lower once in a full run. Without a forced switch of the GIL in
    # between, only this thread runs from the first count to the second.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        with collections_deferred(freeze_from=0):
            pass
        frozen = gc.get_freeze_count()
        with collections_deferred(freeze_from=None):
            pass
        count = gc.get_freeze_count()
    finally:
        sys.setswitchinterval(interval)
    assert frozen >= len(kept)
    assert count == frozen  # only a freezing caller freezes
    thaw()
    assert gc.get_freeze_count() == 0


def test_only_an_open_that_made_many_objects_freezes_them() -> None:
    thaw()
    gc.collect()  # the youngest generation starts empty
    with collections_deferred(freeze_from=50_000):
        few = [[i] for i in range(100)]
    assert gc.get_freeze_count() == 0
    with collections_deferred(freeze_from=50_000):
        many = [[i] for i in range(60_000)]
    assert gc.get_freeze_count() >= len(many) > len(few)


def test_an_error_inside_still_turns_the_collector_back_on() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), collections_deferred(freeze_from=0):
        raise RuntimeError("open failed")
    assert gc.isenabled()
