"""The Ray Serve peer of vs_ray_serve.py in its configurations: requests answered in batches
(`@serve.batch`) get what each gets alone, and benchmarks/rayserve_configs.py runs every
configuration it is given against a real Ray Serve."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from script_support import ROOT, run_benchmark

from benchmarks._peer_batch import answer_batch


class _Loaded:
    """What the multiplexed loader hands back: an object whose `module` is the expert."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module


def _route(x: np.ndarray) -> np.ndarray:
    # Three experts, by the sign pattern of the first two columns (any fixed rule will do).
    return (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)


@pytest.mark.unit
def test_a_batch_answers_each_request_as_it_would_be_answered_alone() -> None:
    torch.manual_seed(0)
    experts = {e: torch.nn.Linear(4, 3) for e in range(3)}
    asked: list[str] = []

    async def get_expert(model_id: str) -> Any:
        asked.append(model_id)
        return _Loaded(experts[int(model_id)])

    rng = np.random.default_rng(0)
    bodies = [{"inputs": rng.standard_normal((n, 4)).tolist()} for n in (1, 4, 3, 2)]
    live = {1}  # expert 1 was loaded before the batch came
    answers = asyncio.run(
        answer_batch(bodies, route=_route, get_expert=get_expert, live=live, output_dim=3)
    )
    assert sorted(asked) == sorted({str(e) for e in _route(_rows(bodies))})  # once each
    for body, answer in zip(bodies, answers, strict=True):
        x = np.asarray(body["inputs"], dtype=np.float32)
        routed = _route(x)
        with torch.no_grad():
            alone = np.stack(
                [
                    experts[int(e)](torch.from_numpy(row)).numpy()
                    for e, row in zip(routed, x, strict=True)
                ]
            )
        np.testing.assert_allclose(answer["outputs"], alone, rtol=1e-5, atol=1e-6)
        assert answer["experts"] == [[int(e)] for e in routed]
        used = set(routed.tolist())
        assert answer["hits"] == int(1 in used)
        assert answer["misses"] == len(used) - int(1 in used)
        assert answer["batch"] == len(bodies)


def _rows(bodies: list[dict[str, Any]]) -> np.ndarray:
    return np.concatenate([np.asarray(b["inputs"], dtype=np.float32) for b in bodies])


@pytest.mark.unit
def test_a_malformed_configuration_is_refused_with_its_form() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rayserve_configs.py"), "--configs",
         "16:eight:1", "--experts", "4", "--widths", "8,4", "--store", "/nonexistent/store"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "'16:eight:1' is not MAX_ONGOING:BATCH:WAIT_MS" in done.stderr


@pytest.mark.ray
@pytest.mark.integration
def test_every_configuration_serves_the_load_without_errors(tmp_path: Path) -> None:
    lines = run_benchmark(
        "rayserve_configs.py", "--configs", "default:0:0,4:4:5", "--rounds", "1",
        "--requests", "120", "--warmup", "20", "--experts", "16", "--widths", "8,64,64,4",
        "--experts-per-actor", "4", "--actors", "2", "--ray-num-cpus", "2",
        "--rows-per-request", "4", "--store", str(tmp_path / "store"),
    )  # fmt: skip
    rounds = [line for line in lines if line.get("round") == 0]
    assert sorted(line["config"] for line in rounds) == ["4:4:5", "default:0:0"]
    for line in rounds:
        assert line["errors"] == 0 and line["rows_per_s"] > 0
    assert sorted(line["config"] for line in lines if line.get("stat") == "median") == [
        "4:4:5", "default:0:0",
    ]


def _median_line(cores: float, serving_ms: float, client_ms: float) -> dict[str, float]:
    # A system whose rows/s is exactly what its busy cores and CPU per row allow.
    return {
        "cpu_cores_busy": cores,
        "cpu_ms_per_row_serving": serving_ms,
        "cpu_ms_per_row_client": client_ms,
        "rows_per_s": 1000.0 * cores / (serving_ms + client_ms),
    }


@pytest.mark.unit
def test_the_ratio_arithmetic_predicts_the_ratio_and_the_cpu_that_3x_allows() -> None:
    from benchmarks.vs_ray_serve import ratio_arithmetic

    momlp = _median_line(1.7, 0.75, 0.15)
    peer = _median_line(1.95, 2.3, 0.25)
    limit = _median_line(1.0, 0.5, 0.0)
    figures = ratio_arithmetic(momlp, peer, limit)
    assert figures["rows_per_s_ratio_predicted"] == pytest.approx(
        momlp["rows_per_s"] / peer["rows_per_s"]
    )
    assert figures["serving_cpu_per_row_to_limit"] == pytest.approx(1.5)
    # At that serving CPU per row momlp would reach exactly 3x the peer's rows/s.
    allowed = figures["serving_cpu_per_row_to_limit_for_3x"] * limit["cpu_ms_per_row_serving"]
    at_3x = _median_line(1.7, allowed, 0.15)
    assert at_3x["rows_per_s"] == pytest.approx(3 * peer["rows_per_s"])
    assert ratio_arithmetic(at_3x, peer, limit)["serving_cpu_per_row_to_limit_for_3x"] == (
        pytest.approx(figures["serving_cpu_per_row_to_limit_for_3x"])
    )
