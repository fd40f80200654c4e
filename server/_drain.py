"""`DrainWindow`: the stop a first signal asks for, put off while load balancers move away.

With `drain_s` > 0 the first SIGTERM/SIGINT to a started server does not stop it: the
readiness probes say 503 draining (`on_begin`), requests are still answered, and the stop
comes `drain_s` later. A second signal stops it at once, as without a window.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["DrainWindow"]


class DrainWindow:
    """`ask()` from the signal handler; `due()` from the event loop's periodic tick."""

    def __init__(
        self,
        drain_s: float,
        on_begin: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._drain_s = drain_s
        self._on_begin = on_begin
        self._clock = clock
        self._asked = False
        self._until: float | None = None

    def ask(self) -> bool:
        """A stop signal came: True when it opens the window (the stop waits), False when
        there is no window or one was opened already (the stop is now)."""
        if self._drain_s <= 0 or self._asked:
            return False
        # Only a flag here: a signal handler may run in the middle of anything, logging too.
        self._asked = True
        return True

    def due(self) -> bool:
        """True once the window has passed; the first call after `ask` opens it."""
        if not self._asked:
            return False
        if self._until is None:
            self._until = self._clock() + self._drain_s
            self._on_begin()
        return self._clock() >= self._until
