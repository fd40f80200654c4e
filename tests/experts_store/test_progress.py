"""`progress_bar`: whole lines, at most one per interval, in a log; tqdm's redraws on a
terminal; nothing when disabled."""

from __future__ import annotations

import io

import pytest

from experts_store import progress_bar

pytestmark = pytest.mark.unit


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_the_first_state_one_line_per_interval_and_the_last() -> None:
    log, clock = io.StringIO(), _Clock()
    bar = progress_bar(30, "experts", "task", stream=log, log_interval_s=10.0, clock=clock)
    for done in range(1, 31):
        clock.now = float(done)  # one second a task
        bar.set_postfix(last=done)  # tqdm redraws on every postfix, whatever its interval
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # Construction (t=0), then t=10, 20, 30 (the 30th postfix), then the close's 30/30.
    assert lines[0].startswith("experts:   0%") and "0/30" in lines[0]
    assert [line.split("last=")[1].rstrip("]") for line in lines[1:4]] == ["10", "20", "30"]
    assert "30/30" in lines[-1] and lines[-1].startswith("experts: 100%")
    assert len(lines) == 5


def test_a_log_gets_the_final_state_even_inside_the_interval() -> None:
    log = io.StringIO()
    with progress_bar(5, "verify", "B", stream=log, log_interval_s=3600.0) as bar:
        bar.update(5)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "0/5" in lines[0] and "5/5" in lines[1]


def test_a_terminal_gets_tqdms_redraws() -> None:
    terminal = _Terminal()
    with progress_bar(3, "pmoe", "epoch", stream=terminal) as bar:
        bar.update(3)
    assert "\r" in terminal.getvalue() and "3/3" in terminal.getvalue()


def test_a_disabled_bar_writes_nothing_and_takes_every_call() -> None:
    log = io.StringIO()
    bar = progress_bar(3, "graph", "epoch", enabled=False, stream=log)
    bar.set_postfix(loss="1")
    bar.update(3)
    bar.close()
    assert log.getvalue() == ""
