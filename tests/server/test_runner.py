from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from server._runner import freeze_heap

pytestmark = pytest.mark.unit


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session keeps a normal GC


def test_freeze_heap_exempts_what_is_alive_and_collects_garbage_first(unfrozen: None) -> None:
    kept = Node()
    first, second = Node(), Node()
    first.other, second.other = second, first  # a cycle that only the cyclic GC can free
    cycle = weakref.ref(first)
    del first, second

    frozen = freeze_heap()

    assert frozen == gc.get_freeze_count() > 0
    assert cycle() is None  # collected, not frozen
    # Frozen objects are no longer on the lists a collection traverses.
    assert not any(obj is kept for obj in gc.get_objects())
