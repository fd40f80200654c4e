"""A failed load frees what it allocated at once, not at the next full garbage collection.

On a CUDA actor a load that fails after its copy (weights that are NaN, an arch that differs
from the manifest's) has a device copy of the expert in its frames. The cache kept the error
for the load's waiters, and the error's traceback holds the loading frame, which holds the
cache entry, which held the error: a cycle that kept that copy, outside the budget, until the
collector's oldest generation ran. A request per second for a broken expert added one copy a
second.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
from cache_helpers import wait_until

from experts_store import ExpertCache

pytestmark = pytest.mark.unit


class CopyThenFail:
    """A loader whose load allocates a tensor (the device copy) and then refuses the expert."""

    def __init__(self) -> None:
        self.copies: list[weakref.ref[torch.Tensor]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def nbytes(self, key: int) -> int:
        return 10

    def load(self, key: int) -> str:
        copy = torch.zeros(1024)
        self.copies.append(weakref.ref(copy))
        self.started.set()
        assert self.release.wait(10)
        raise ValueError(f"expert {key}: its weights hold NaN or infinite values")


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counting frees anything during the test, as between two collections."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _lease(cache: ExpertCache[str], errors: list[str]) -> None:
    try:
        with cache.lease(0):
            pass
    except ValueError as exc:
        errors.append(str(exc))  # the text only: the error itself would hold its frames


@pytest.mark.usefixtures("no_collector")
def test_a_failed_load_frees_its_copy_as_soon_as_the_error_is_handled() -> None:
    loader = CopyThenFail()
    loader.release.set()
    cache: ExpertCache[str] = ExpertCache(100, loader)
    errors: list[str] = []
    _lease(cache, errors)
    assert errors == ["expert 0: its weights hold NaN or infinite values"]
    assert [copy() for copy in loader.copies] == [None]


@pytest.mark.usefixtures("no_collector")
def test_a_failed_load_with_waiters_frees_its_copy_once_every_waiter_has_its_error() -> None:
    loader = CopyThenFail()
    cache: ExpertCache[str] = ExpertCache(100, loader)
    errors: list[str] = []
    threads = [threading.Thread(target=_lease, args=(cache, errors)) for _ in range(3)]
    threads[0].start()
    assert loader.started.wait(10)
    for thread in threads[1:]:
        thread.start()
    wait_until(lambda: cache.waiting == 2)
    loader.release.set()
    for thread in threads:
        thread.join()
    assert errors == ["expert 0: its weights hold NaN or infinite values"] * 3
    assert len(loader.copies) == 1 and loader.copies[0]() is None
    # The next lease loads afresh (and fails afresh), freeing that copy too.
    _lease(cache, errors)
    assert len(loader.copies) == 2 and all(copy() is None for copy in loader.copies)


class DeadlineAsTheLoadFails(ExpertCache[str]):
    """A waiter's deadline passes in the same moment as the load it waits on fails."""

    def __init__(self, loader: CopyThenFail) -> None:
        super().__init__(100, loader)
        self.loader = loader

    def _wait(self, deadline: float | None) -> bool:
        self.loader.release.set()
        self._cond.wait(10)  # until the failed load is recorded (it notifies)
        return False


@pytest.mark.usefixtures("no_collector")
def test_a_waiter_whose_deadline_passes_as_the_load_fails_takes_the_error() -> None:
    # It raised CacheBusy and left the error on the entry, still counted as a waiter's: the
    # cycle kept the failed load's copy until a full collection.
    loader = CopyThenFail()
    cache = DeadlineAsTheLoadFails(loader)
    errors: list[str] = []
    first = threading.Thread(target=_lease, args=(cache, errors))
    first.start()
    assert loader.started.wait(10)
    try:
        with cache.lease(0, timeout=5.0):
            pass
    except ValueError as exc:
        errors.append(str(exc))
    first.join()
    assert errors == ["expert 0: its weights hold NaN or infinite values"] * 2
    assert len(loader.copies) == 1 and loader.copies[0]() is None
