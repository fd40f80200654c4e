"""benchmarks/_jobs.gather_rows: the paper scripts' Ray jobs, each row kept as it finishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks._jobs import gather_rows

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]


def test_each_row_is_kept_saved_and_reported_as_it_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def job(index: int) -> dict[str, Any]:
        return {"index": index, "square": index * index}

    raw = tmp_path / "raw.jsonl"
    rows = gather_rows(
        [job.remote(i) for i in range(4)], raw=raw, describe=lambda row: f"job {row['index']}"
    )
    assert sorted(row["index"] for row in rows) == [0, 1, 2, 3]
    assert all(row["square"] == row["index"] ** 2 for row in rows)
    assert [json.loads(line) for line in raw.read_text().splitlines()] == rows
    progress = capsys.readouterr().err.splitlines()
    assert progress == [f"[{n + 1}/4] job {row['index']}" for n, row in enumerate(rows)]
