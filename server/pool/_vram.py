"""A CUDA actor's activation bytes, read from the allocator's counters once per block shape.

The allocator's peak counter belongs to the device, not to a thread. Read around every
group, it also counted what other threads allocated in the meantime: on an H100 under
`momlp loadtest`, 23 % of the requests reported about one more expert (1.14 MB) as their
activation share, the expert that the look-ahead or a prefetch was loading then
(benchmarks/RESULTS.md, "The second GPU session"). And every read builds the allocator's
whole statistics dict: two reads and a reset per group.

What a forward allocates depends only on its shape: the expert's architecture and how many
blocks of rows it runs. So `ActivationMeter` measures each shape once, at a moment when no
other thread of the actor touches device memory, and reuses that figure. Threads that load
or evict hold `DeviceQuiet.shared`; the measurement holds `DeviceQuiet.exclusive`, which
waits for the loads in flight to end (new ones wait behind it) for at most `QUIET_WAIT_S`.
It cannot wait longer: the look-ahead's load may itself be waiting for room that the
computing group's lease holds. If the loads do not end in time the group is measured as
before (its figure may then include another thread's bytes) and the next group of that shape
tries again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

import torch

__all__ = [
    "QUIET_WAIT_S", "ActivationMeter", "AllocatorCounters", "CudaCounters", "DeviceQuiet",
]

# How long a first measurement of a shape waits for loads in flight: a 16 MiB expert loaded
# in ~3.5 ms on an H100 (a 128 MiB one in ~25 ms), and this wait comes once per shape.
QUIET_WAIT_S = 0.1

T = TypeVar("T")


class AllocatorCounters(Protocol):
    """The device allocator's byte counters (torch.cuda's; a fake in tests)."""

    def reset_peak(self) -> None: ...

    def allocated(self) -> int: ...

    def peak(self) -> int: ...


class CudaCounters:
    """torch's caching allocator on one CUDA device."""

    def __init__(self, device: str) -> None:
        self._device = device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self._device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self._device))


class DeviceQuiet:
    """Many threads may allocate device memory at once (`shared`), or one may need the device
    to itself for a moment (`exclusive`)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._sharing = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._condition:
            # Behind an exclusive holder or waiter: each is one forward, or QUIET_WAIT_S.
            while self._exclusive or self._waiting:
                self._condition.wait()
            self._sharing += 1
        try:
            yield
        finally:
            with self._condition:
                self._sharing -= 1
                if self._sharing == 0:
                    self._condition.notify_all()

    @contextmanager
    def exclusive(self, timeout_s: float) -> Iterator[bool]:
        """Yields whether the device was this thread's alone for the whole block: shared
        holders ended within `timeout_s` (none may start until the block ends)."""
        with self._condition:
            self._waiting += 1
            try:
                got = self._condition.wait_for(
                    lambda: not self._exclusive and self._sharing == 0, timeout=timeout_s
                )
            finally:
                self._waiting -= 1
            if got:
                self._exclusive = True
            else:
                self._condition.notify_all()  # shared() waiters held back by this wait
        try:
            yield got
        finally:
            if got:
                with self._condition:
                    self._exclusive = False
                    self._condition.notify_all()


# Shapes whose figures a meter keeps: a store's archs times the block counts of a batch
# (64 at most per arch on CUDA with 4,096-row batches). Unbounded, every arch of every
# version a server ever swapped to stayed; past this the figures are measured afresh.
_MAX_SHAPES = 4096


class ActivationMeter:
    """Bytes a forward of each shape allocates beyond what was allocated before it."""

    def __init__(self, counters: AllocatorCounters, quiet: DeviceQuiet) -> None:
        self._counters = counters
        self._quiet = quiet
        self._known: dict[Hashable, int] = {}

    def run(self, shape: Hashable, forward: Callable[[], T]) -> tuple[T, int]:
        """`forward()` and its activation bytes; `shape` names everything they depend on."""
        known = self._known.get(shape)
        if known is not None:
            return forward(), known
        with self._quiet.exclusive(QUIET_WAIT_S) as alone:
            self._counters.reset_peak()
            base = self._counters.allocated()
            out = forward()
            nbytes = self._counters.peak() - base
        if alone:
            if len(self._known) >= _MAX_SHAPES:
                self._known.clear()
            self._known[shape] = nbytes
        return out, nbytes
