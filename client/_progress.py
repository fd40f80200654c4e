"""The load test's live progress line: done/total, req/s, p50 of the latest answers, errors."""

from __future__ import annotations

from collections import deque
from typing import TextIO

from ._figures import percentile
from ._loadtest_config import LoadTestConfig
from ._records import RequestRecord

__all__ = ["Progress"]


class Progress:
    """A live `\\r` line on a stream: done/total, req/s, p50 of the latest answers, errors.

    On a stream that is not a terminal (a log file, CI) `\\r` would glue the updates into
    one line, so there each update is its own line, and they come less often. Each update
    reads only the records that came since the last one and takes the p50 of the latest
    `recent` answers: over every answer so far, an update of a long run sorted hundreds of
    thousands of latencies twice a second on the event loop the requests wait on.
    """

    def __init__(
        self,
        stream: TextIO,
        config: LoadTestConfig,
        interval_s: float = 0.5,
        recent: int = 1000,
    ) -> None:
        self.stream = stream
        self.config = config
        isatty = getattr(stream, "isatty", None)
        self._live = bool(isatty()) if callable(isatty) else False
        self.interval_s = interval_s if self._live else max(interval_s, 5.0)
        self._last = -self.interval_s
        self._seen = 0
        self._errors = 0
        self._recent: deque[float] = deque(maxlen=recent)

    def update(self, records: list[RequestRecord], elapsed: float) -> None:
        if elapsed - self._last >= self.interval_s:
            self._last = elapsed
            self._write(records, elapsed)

    def finish(self, records: list[RequestRecord], elapsed: float) -> None:
        self._write(records, elapsed)
        if self._live:
            self.stream.write("\n")
        self.stream.flush()

    def _write(self, records: list[RequestRecord], elapsed: float) -> None:
        for record in records[self._seen :]:
            if record.ok:
                self._recent.append(record.latency_ms)
            else:
                self._errors += 1
        done = self._seen = len(records)
        if self.config.requests is not None:
            where = f"{done}/{self.config.requests}"
        else:
            where = f"{done} req, {elapsed:.0f}/{self.config.duration_s:.0f} s"
        rate = done / elapsed if elapsed > 0 else 0.0
        p50 = percentile(list(self._recent), 50) if self._recent else 0.0
        line = (
            f"{where}  {rate:.1f} req/s  p50 {p50:.1f} ms (last {len(self._recent)})"
            f"  errors {self._errors}"
        )
        self.stream.write(f"\r{line}   " if self._live else f"{line}\n")
        self.stream.flush()
