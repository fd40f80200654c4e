"""The cyclic garbage collector, kept out of the way while a store version is opened.

Opening a K=100,000 store version makes ~1.3 million objects that outlive it. Made with the
collector on, they set off full collections of everything the process holds: 250-520 ms
each, four of them per open, each holding the GIL, so the event loop stood still that long
(benchmarks/RESULTS.md, fifty-third session). Inside `collections_deferred` there is no
cyclic collection (reference counting still frees nearly everything). With `freeze_from`,
once at least that many tracked objects were made inside, what is alive at its end (the
version just opened among it) is moved where later collections do not scan it, as
`gc.freeze` does for a pre-forking server; otherwise turning the collector back on would
start with a collection of all of them. An object frozen this way that later dies in a
reference cycle is not reclaimed until `thaw()`, which the server calls when it stops, so
only opens that need it freeze: the start (a process holding the server's modules and the
issue store's version had ~180,000 objects, and a full collection of them took 77 ms) and
swaps of large stores. A version's own objects hold no cycles, so a
retired version is freed all the same.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collections_deferred", "thaw"]

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextlib.contextmanager
def collections_deferred(*, freeze_from: int | None) -> Iterator[None]:
    """No cyclic garbage collection in the process while any caller is inside (threads
    overlap: the last one out turns it back on, if it was on). `freeze_from`: freeze at the
    end when the youngest generation holds at least that many objects (0: always; None:
    never)."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            if freeze_from is not None and gc.get_count()[0] >= freeze_from:
                gc.freeze()
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()


def thaw() -> None:
    """Hand what `freeze` set aside back to the collector (a stopping server's last step)."""
    gc.unfreeze()
