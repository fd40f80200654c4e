"""A request waiting in a batcher, and which of the waiting requests make up a batch.

A batch holds the requests of one key (the kind's resolved options) in the order they came,
up to `max_batch_rows` rows (a request larger than that goes alone). Requests whose caller has
left (their future is done) are passed over.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from server.batching._types import BatchAnswer

__all__ = ["Pending", "fail", "prefetch_head", "take_batch", "waited"]


@dataclass(eq=False)
class Pending:
    """One request in a batcher's queue, from `submit` until it is answered."""

    x: torch.Tensor
    options: Hashable
    submitted: float
    # The request's share of its finished batch, built in the request's own coroutine.
    future: asyncio.Future[Callable[[], BatchAnswer]]
    rows: int = field(init=False)
    routing: Any = None  # set when the request was routed ahead of its batch (prefetch)
    # Taken into a batch: from then on its rows leave `queued_rows` when the batch ends, not
    # when the caller leaves (a timeout does not stop their computing).
    dispatched: bool = False
    counted: bool = True  # its rows are still in `queued_rows`

    def __post_init__(self) -> None:
        self.rows = int(self.x.shape[0])

    @property
    def key(self) -> Hashable:
        return self.options


def take_batch(queue: deque[Pending], max_rows: int) -> tuple[list[Pending], deque[Pending]]:
    """The batch of the first waiting request's key, each marked dispatched, and the requests
    that stay queued, in order (those whose caller has left are dropped)."""
    if not queue:
        return [], queue
    key = queue[0].key
    batch: list[Pending] = []
    rows = 0
    kept: deque[Pending] = deque()
    while queue:
        item = queue.popleft()
        if item.future.done():
            continue
        fits = not batch or rows + item.rows <= max_rows
        if item.key == key and fits:
            item.dispatched = True
            batch.append(item)
            rows += item.rows
        else:
            kept.append(item)
    return batch, kept


def prefetch_head(queue: Iterable[Pending], max_rows: int) -> list[Pending]:
    """The requests at the head of the queue not routed yet, as far as they would share one
    batch: one key, up to `max_rows` rows."""
    head: list[Pending] = []
    rows = 0
    for item in queue:
        if item.routing is not None or item.future.done():
            continue
        full = rows + item.rows > max_rows
        if head and (item.key != head[0].key or full):
            break
        head.append(item)
        rows += item.rows
    return head


def fail(batch: list[Pending], exc: BaseException) -> None:
    """Fail the requests of `batch` not answered yet with `exc`."""
    for item in batch:
        if not item.future.done():
            item.future.set_exception(exc)


def waited(batch: Iterable[Pending]) -> bool:
    """Whether a caller of the batch still waits for its answer. One whose request timed out,
    or whose client hung up (under `momlp serve`: `server.http.client_gone`), has its future
    cancelled, as the awaiting task is."""
    return any(not item.future.done() for item in batch)
