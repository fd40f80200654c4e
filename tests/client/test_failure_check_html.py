"""report.html's --max-failed-fraction rows show a failed fraction a reader can tell from 0:
the verdict beside them says "failed" only where the table shows a fraction above the limit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from client._html import render_html
from client._report import RequestRecord, build_report

pytestmark = pytest.mark.unit


def _row_text(page: str, key: str) -> str:
    """The value cell of the summary row tied to report.json's `key`."""
    match = re.search(
        rf'<tr data-key="{re.escape(key)}"><td>[^<]*</td><td class="num">([^<]*)</td>', page
    )
    assert match is not None, key
    return match.group(1)


@pytest.mark.parametrize("requests", [20_001, 100_000])
def test_one_failure_in_a_long_run_is_not_shown_as_a_failed_fraction_of_zero(
    tmp_path: Path, requests: int
) -> None:
    # One request of a long CI run failed; --max-failed-fraction 0 fails the run.
    records = [
        RequestRecord(i, i * 1e-4, i * 1e-4 + 1e-3, 1, "503" if i == 7 else "200")
        for i in range(requests)
    ]
    report = build_report(
        records, duration_s=requests * 1e-4, dense_equivalent_bytes=1, max_expert_bytes=1,
        config={}, model={}, workload={}, max_failed_fraction=0.0,
    )
    assert report.failure_check is not None and report.failure_check["passed"] is False
    page = render_html(report, tmp_path)
    assert "failed (at most 0 of the requests may fail)" in page
    shown = _row_text(page, "failure_check/failed_fraction")
    allowed = _row_text(page, "failure_check/max_failed_fraction")
    # It read "0.0000" beside an allowed "0.0000" under a verdict of "failed".
    assert float(shown) > float(allowed) == 0.0, (shown, allowed)
    assert float(shown) == pytest.approx(1 / requests, rel=1e-3)
