"""A graph store through a real `momlp serve` (uvicorn on loopback, embedded Ray, 2 actors):
outputs equal the offline composite, and a deleted node expert fails only its requests."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from graph_support import global_ids, inputs, offline, tiny_graph_store
from live_support import serve_process

pytestmark = [pytest.mark.integration, pytest.mark.ray]


def test_served_graph_equals_the_offline_composite_and_a_deleted_node_expert_fails_only_its_rows(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    first = tiny_graph_store(store, seed=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    args = ["--store", str(store), "--port", "0", "--actors", "2", "--ray-num-cpus", "2",
            "--no-watch-store", "--max-rows", "1000"]
    with serve_process(args, env=env, cwd=tmp_path) as served, httpx.Client(
        base_url=served.url, timeout=60
    ) as http:
        # 1,000 rows in one request: every node's expert per row, outputs to 1e-5.
        x = inputs(1000, seed=7)
        hard = offline(first, x)
        body = http.post("/v1/predict", json={"inputs": x.tolist(), "return_stats": True}).json()
        # K_v = 4, ν = 4: one level of a balanced tree, ≤ ν⌈log_ν K_v⌉ = 4 per node per row.
        assert all(max(v) <= 4 for v in body["stats"]["graph"]["node_distance_evals"].values())
        assert torch.allclose(torch.tensor(body["outputs"]), hard.outputs, atol=1e-5, rtol=0)
        assert body["nodes"] == global_ids(first, hard)
        assert all(len(experts) == 1000 for experts in body["nodes"].values())
        assert all(len(row) == 7 for row in body["experts"])  # one expert per node per row

        # A new version whose node expert file is deleted: only requests needing it fail.
        second = tiny_graph_store(store, seed=1)
        rows = inputs(40, seed=8)
        used = global_ids(second, offline(second, rows))
        node = next(n for n in ("l1_0", "l1_1", "root", "l0_0")
                    if len(set(used[n])) > 1)
        expert = max(set(used[node]), key=used[node].count)
        manifest = json.loads((store / "manifest.json").read_text())
        (store / manifest["experts"][expert]["file"]).unlink()
        assert http.post("/v1/admin/reload").status_code == 200
        expected = offline(second, rows).outputs

        async def one_by_one() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
                return await asyncio.gather(*(
                    client.post("/v1/predict", json={"inputs": [row]}) for row in rows.tolist()
                ))

        answers = asyncio.run(one_by_one())
        for r, answer in enumerate(answers):
            if used[node][r] == expert:
                assert answer.status_code == 503, answer.text
                error = answer.json()["error"]
                assert error["detail"]["node"] == node
                assert error["detail"]["expert_id"] == expert
                assert f"node '{node}' expert {expert}" in error["message"]
            else:
                assert answer.status_code == 200, answer.text
                got = torch.tensor(answer.json()["outputs"][0])
                assert torch.allclose(got, expected[r], atol=1e-5, rtol=0)
        assert 0 < sum(a.status_code == 503 for a in answers) < len(answers)
