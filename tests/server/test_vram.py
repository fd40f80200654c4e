"""The CUDA actor's activation meter, with fake allocator counters (runs without a GPU).

A load on another thread must not show in a forward's figure: the meter measures a shape once,
while no load is in flight, and reuses it (server/pool/_vram.py). The real counters are
exercised by tests/server/test_cuda_vram.py on a GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pytest import MonkeyPatch

import server.pool._vram as vram
from server.pool._vram import ActivationMeter, DeviceQuiet


class FakeCounters:
    """A device allocator's counters; `allocate` and `free` are what tensors would do."""

    def __init__(self) -> None:
        self.current = 1_000
        self.top = self.current
        self.reads = 0
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            self.top = max(self.top, self.current)

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes

    def reset_peak(self) -> None:
        self.reads += 1
        self.top = self.current

    def allocated(self) -> int:
        self.reads += 1
        return self.current

    def peak(self) -> int:
        self.reads += 1
        return self.top


def forward_of(counters: FakeCounters, nbytes: int) -> Callable[[], str]:
    def forward() -> str:
        counters.allocate(nbytes)  # activations, freed at the end; the output stays
        counters.free(nbytes - 100)
        return "y"

    return forward


def load_in_flight(
    quiet: DeviceQuiet, release: threading.Event, then: Callable[[], None]
) -> threading.Thread:
    """A thread inside `quiet.shared()` (a load) until `release`, which then runs `then`."""
    loading = threading.Event()

    def load() -> None:
        with quiet.shared():
            loading.set()
            release.wait(5)
            then()

    loader = threading.Thread(target=load)
    loader.start()
    loading.wait(5)
    return loader


def test_each_shape_is_measured_once_and_its_figure_reused() -> None:
    counters = FakeCounters()
    meter = ActivationMeter(counters, DeviceQuiet())
    assert meter.run(("a", 1), forward_of(counters, 5_000)) == ("y", 5_000)
    reads = counters.reads
    assert meter.run(("a", 1), forward_of(counters, 5_000)) == ("y", 5_000)
    assert counters.reads == reads  # no counter read for a known shape
    assert meter.run(("a", 2), forward_of(counters, 9_000)) == ("y", 9_000)
    assert counters.reads == reads + 3


def test_a_load_that_starts_during_the_measurement_waits_for_it() -> None:
    counters = FakeCounters()
    quiet = DeviceQuiet()
    meter = ActivationMeter(counters, quiet)
    order: list[str] = []

    def load() -> None:
        with quiet.shared():
            order.append("load")
            counters.allocate(1_000_000)  # an expert arriving on the device

    loader = threading.Thread(target=load)

    def forward() -> str:
        loader.start()
        time.sleep(0.05)  # the loader would have allocated by now if it could
        counters.allocate(5_000)
        counters.free(4_900)
        order.append("forward")
        return "y"

    assert meter.run("shape", forward) == ("y", 5_000)
    loader.join()
    assert order == ["forward", "load"]
    assert meter.run("shape", forward_of(counters, 7)) == ("y", 5_000)


def test_the_measurement_waits_for_a_load_in_flight_to_end() -> None:
    counters = FakeCounters()
    quiet = DeviceQuiet()
    meter = ActivationMeter(counters, quiet)
    release = threading.Event()
    loader = load_in_flight(quiet, release, lambda: counters.allocate(1_000_000))
    threading.Timer(0.02, release.set).start()

    def slow() -> str:
        time.sleep(0.05)  # long enough for the load to land inside it, had it not waited
        return forward_of(counters, 5_000)()

    # The load allocates before the measurement begins: not in the figure.
    assert meter.run("shape", slow) == ("y", 5_000)
    loader.join()


def test_a_load_that_outlasts_the_wait_is_measured_again_next_time() -> None:
    counters = FakeCounters()
    quiet = DeviceQuiet()
    meter = ActivationMeter(counters, quiet)
    release = threading.Event()
    # E.g. a look-ahead load waiting for room that the computing group's lease holds.
    loader = load_in_flight(quiet, release, lambda: None)

    def contaminated() -> str:
        counters.allocate(1_000_000)  # the other thread's bytes land during this forward
        return forward_of(counters, 5_000)()

    started = time.monotonic()
    assert meter.run("shape", contaminated) == ("y", 1_005_000)
    assert time.monotonic() - started < 2  # it waited QUIET_WAIT_S, not for the load
    release.set()
    loader.join()
    # Not kept: the next forward of that shape is measured again, now alone.
    assert meter.run("shape", forward_of(counters, 5_000)) == ("y", 5_000)
    assert meter.run("shape", contaminated) == ("y", 5_000)


def test_loads_share_the_device_with_each_other() -> None:
    quiet = DeviceQuiet()
    inside = threading.Barrier(3, timeout=5)

    def load() -> None:
        with quiet.shared():
            inside.wait()  # all three at once, or the barrier breaks

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    with quiet.shared():
        inside.wait()
    for thread in threads:
        thread.join()
    assert not inside.broken


def test_the_figures_kept_stay_bounded_across_many_archs(monkeypatch: MonkeyPatch) -> None:
    # Each store version swapped to may bring archs of its own: a meter on a server that
    # swaps for weeks must not keep a figure for every shape it ever measured.
    monkeypatch.setattr(vram, "_MAX_SHAPES", 8, raising=False)
    counters = FakeCounters()
    meter = ActivationMeter(counters, DeviceQuiet())
    for arch in range(100):
        assert meter.run((f"arch-{arch}", 1), forward_of(counters, 5_000)) == ("y", 5_000)
    assert len(meter._known) <= 8
    # A figure dropped is measured again, the same.
    assert meter.run(("arch-0", 1), forward_of(counters, 5_000)) == ("y", 5_000)
