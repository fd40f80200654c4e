"""Blocking work off the event loop on a daemon thread: a call that hangs (a read on a hung
mount, a kill a slow GCS holds) neither keeps the interpreter from exiting nor occupies the
default executor, as `asyncio.to_thread`'s would."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_daemon_thread"]

R = TypeVar("R")


def in_daemon_thread(fn: Callable[..., R], *args: Any) -> asyncio.Future[R]:
    """Run `fn(*args)` on a daemon thread; its result or exception lands in the future.

    Unlike `asyncio.to_thread`, an abandoned call (a read stuck on a hung mount) neither
    blocks the interpreter's exit nor occupies the default executor.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[R] = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            outcome: tuple[Callable[[Any], None], Any] = (future.set_exception, exc)
        else:
            outcome = (future.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(deliver, *outcome)

    name = getattr(fn, "__name__", "call")  # a functools.partial has none
    threading.Thread(target=work, name=f"momlp-{name}", daemon=True).start()
    return future
