"""`progress_bar`: a long command's tqdm bar, readable in a log as well as on a terminal.

On a terminal tqdm redraws one line with carriage returns. Written to a file or a pipe (a
build under nohup, a CI job, a container's log), those redraws become one line that grows
for the whole command. There the bar writes whole lines instead: at most one every
`log_interval_s`, and the last state when it closes.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["LOG_INTERVAL_S", "progress_bar"]

LOG_INTERVAL_S = 10.0


class _Lines:
    """The stream tqdm writes to when the real one is not a terminal.

    tqdm redraws on every `set_postfix` whatever its `mininterval`, so the interval is kept
    here: the first redraw, then the latest at most every `interval_s`, then the last one
    when the bar closes (tqdm's close ends with a bare newline).
    """

    def __init__(
        self, stream: IO[str], interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stream = stream
        self._interval_s = interval_s
        self._clock = clock
        self._pending = ""
        self._written = ""
        self._written_at = -math.inf
        # tqdm picks its bar characters by the stream's encoding.
        self.encoding = getattr(stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self._pending = line
        now = self._clock()
        closing = not line and "\n" in text
        if (closing or now - self._written_at >= self._interval_s) and (
            self._pending != self._written
        ):
            self._stream.write(self._pending + "\n")
            self._written, self._written_at = self._pending, now
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(callable(isatty) and isatty())


def progress_bar(
    total: int,
    desc: str,
    unit: str,
    *,
    enabled: bool = True,
    stream: IO[str] | None = None,
    log_interval_s: float = LOG_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    **options: Any,
) -> Any:
    """A tqdm bar over `total` on `stream` (stderr), or a disabled one (its methods do
    nothing) when not `enabled`; `options` go to tqdm (`unit_scale`, ...)."""
    from tqdm import tqdm

    out = sys.stderr if stream is None else stream
    if not enabled:
        return tqdm(total=total, disable=True)
    if _is_terminal(out):
        return tqdm(total=total, desc=desc, unit=unit, file=out, **options)
    return tqdm(
        total=total, desc=desc, unit=unit, file=_Lines(out, log_interval_s, clock),
        mininterval=log_interval_s,
        **options,
    )
