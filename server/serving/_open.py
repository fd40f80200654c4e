"""Reading and opening a store version on disk, beside the requests being served.

The serving state calls these on a daemon thread (a read stuck on a bad file system never
holds up shutdown); they run at a pace that gives the GIL back to the event loop, with the
cyclic collector kept out of the way (server/serving/_collect.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from experts_store import Pace, Pacer, Store, no_pace
from server.kinds import ServedModel, open_model
from server.pool import check_budget
from server.serving._collect import collections_deferred
from server.serving._version import StoreVersionReader

__all__ = [
    "SWAP_FREEZE_FROM_OBJECTS",
    "background_pacer",
    "open_version_files",
    "read_on_disk",
]

# A swap opens the new version beside requests that are being served: its passes over the
# store's experts give the GIL back for 1 ms after each 2 ms of work (experts_store.Pacer). At
# K=100,000 under 16 clients the slowest request during a reload fell from 1.9-3.1 s to
# 0.23-0.26 s, and the reload took ~9 s instead of 3.4-4.6 (RESULTS.md, fifty-third session).
_SWAP_PACE_WORK_S = 0.002
_SWAP_PACE_REST_S = 0.001
# A swap that made this many objects freezes them (server/serving/_collect.py): ~4 objects an
# expert (~13 when this was set), so stores of ~12,500 experts and up; turning the collector
# back on with fewer costs a young collection of ~20 ms at most (0.4 µs an object here).
SWAP_FREEZE_FROM_OBJECTS = 50_000


def open_version_files(
    root: Path,
    budget_bytes: int,
    pace: Pace | None,
    freeze_from: int,
    previous: Store | None,
    opened: Callable[[str], None],
) -> tuple[Store, ServedModel]:
    """The store at `root` and its served model, checked against one actor's cache.

    A kind this server does not know is refused here, naming it (UnknownStoreKind): at
    startup the server does not start, on a reload the old version keeps serving. The
    served version's rows and refs (`previous`) are taken where the new manifest left them
    unchanged. `opened` learns the version of the manifest read, which a failure after it
    concerns.
    """
    with collections_deferred(freeze_from=freeze_from):
        store = Store.open(root, pace=pace, previous=previous)
        opened(store.version)
        model = open_model(store, pace or no_pace)
        check_budget(model.experts, budget_bytes)  # a pass over every expert: off the loop too
    return store, model


def read_on_disk(reader: StoreVersionReader, pace: Pace) -> str | None:
    """`reader.store_version(pace)`, with the cyclic collector kept out of the way."""
    # A changed manifest whose start lacks the version is parsed up to it, maybe whole: then
    # as many objects as the open's, if short-lived.
    with collections_deferred(freeze_from=None):
        return reader.store_version(pace)


def background_pacer() -> Pacer:
    """The pace of a long run of Python on a thread beside the event loop (a swap's open)."""
    return Pacer(_SWAP_PACE_WORK_S, _SWAP_PACE_REST_S)

