"""The Voronoi losses and the least-squares fit behind benchmarks/seed002_rates.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.seed002_moe import KINDS, fit_one, regression, true_params, voronoi_loss
from benchmarks.seed002_rates import main, resume_from

pytestmark = pytest.mark.unit


def split_first_atom(kind: str) -> dict[str, torch.Tensor]:
    """The truth written with three atoms: the first split into two equal halves."""
    truth = true_params(kind)
    idx = torch.tensor([0, 0, 1])
    if kind == "hier":
        half = torch.tensor([math.log(2.0), math.log(2.0), 0.0], dtype=torch.float64)
        return {"beta1": truth["beta1"], "w1": truth["w1"], "nu": truth["nu"][:, idx] - half,
                "kappa": truth["kappa"][:, idx], "eta": truth["eta"][:, idx]}
    tau = truth.get("tau", torch.ones((), dtype=torch.float64))
    half = tau * torch.tensor([math.log(2.0), math.log(2.0), 0.0], dtype=torch.float64)
    split = {"beta": truth["beta"][idx] - half, "w": truth["w"][idx], "eta": truth["eta"][idx]}
    if "tau" in truth:
        split["tau"] = truth["tau"]
    return split


@pytest.mark.parametrize("kind", KINDS)
def test_voronoi_loss_is_zero_at_the_truth_and_positive_off_it(kind: str) -> None:
    truth = true_params(kind)
    split = split_first_atom(kind)
    x = torch.rand(500, 2, dtype=torch.float64) * 2 - 1
    # The split mixture is the same regression function, so the loss must not see the split.
    torch.testing.assert_close(regression(kind, split, x), regression(kind, truth, x))
    assert voronoi_loss(kind, truth) == 0.0
    assert voronoi_loss(kind, split) == pytest.approx(0.0, abs=1e-12)
    for key, value in split.items():
        moved = dict(split)
        moved[key] = value + 0.05
        loss = voronoi_loss(kind, moved)
        assert loss > 1e-3, key
        # Half the step: an over-specified cell counts squared distances, an exact one
        # plain distances, so the loss shrinks by a factor between 2 and 4.
        moved[key] = value + 0.025
        assert loss / 4.5 < voronoi_loss(kind, moved) < loss / 1.5, key


def test_loss_counts_an_exact_cell_linearly_and_an_over_specified_one_squared() -> None:
    truth = true_params("sigmoid")
    moved = dict(truth)
    moved["eta"] = truth["eta"] + torch.tensor([[0.1, 0.0, 0.0], [0.0, 0.0, 0.0]],
                                               dtype=torch.float64)
    assert voronoi_loss("sigmoid", moved) == pytest.approx(math.exp(0.5) * 0.1)
    split = split_first_atom("sigmoid")
    split["eta"] = split["eta"] + torch.tensor(
        [[0.1, 0.0, 0.0], [-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert voronoi_loss("sigmoid", split) == pytest.approx(math.exp(0.5) * 0.01)


def test_a_small_fit_recovers_the_truth() -> None:
    result = fit_one("sigmoid", 2000, seed=0, replicate=0)
    assert not result["failed"], result["reason"]
    assert result["objective"] <= result["objective_truth"]
    # The regression function is estimated at the noise level / sqrt(n) scale.
    assert result["regression_rmse"] < 0.03
    fitted = {k: torch.tensor(v, dtype=torch.float64) for k, v in result["fitted"].items()}
    truth = true_params("sigmoid")
    # The exactly-specified component (third fitted, second true atom) lands near its atom,
    # and the over-specified cell's masses add up to the first atom's.
    assert float((fitted["w"][2] - truth["w"][1]).norm()) < 0.3
    assert float((fitted["eta"][2] - truth["eta"][1]).norm()) < 0.3
    assert float(fitted["beta"][:2].exp().sum()) == pytest.approx(math.exp(0.5), rel=0.15)


def test_resume_keeps_finished_fits_and_drops_a_cut_last_line(tmp_path: Path) -> None:
    raw = tmp_path / "fits.jsonl"
    done = [
        {"kind": "sigmoid", "n": 1000, "seed": 1, "replicate": 0, "voronoi_loss": 1.0},
        {"kind": "linear", "n": 1000, "seed": 1, "replicate": 1, "voronoi_loss": 2.0},
        # Another seed's fit in the same file is not one of this run's jobs.
        {"kind": "sigmoid", "n": 1000, "seed": 9, "replicate": 0, "voronoi_loss": 3.0},
    ]
    raw.write_text("".join(json.dumps(r) + "\n" for r in done) + '{"kind": "sigm')
    jobs = [(kind, 1000, 1, rep) for kind in ("sigmoid", "linear") for rep in range(2)]
    kept, left = resume_from(raw, jobs)
    assert [r["voronoi_loss"] for r in kept] == [1.0, 2.0]
    assert left == [("sigmoid", 1000, 1, 1), ("linear", 1000, 1, 0)]
    # The file now ends on a line boundary and holds just the kept fits.
    assert [json.loads(line) for line in raw.read_text().splitlines()] == done[:2]


def fake_fits(seed: int, kind: str, slope: float) -> list[dict[str, object]]:
    """Fits whose losses fall exactly as n^slope (every replicate alike), none failed."""
    return [
        {"kind": kind, "n": n, "seed": seed, "replicate": rep,
         "voronoi_loss": float(n) ** slope, "regression_rmse": 0.01, "failed": False,
         "reason": "", "seconds": 1.0}
        for n in (1000, 10000, 100000) for rep in range(3)
    ]


def test_from_raw_reads_one_file_per_seed_and_counts_seeds_that_meet_the_goal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # sigmoid meets -1/2 in both seeds; linear is flatter by 0.4 in seed 0, by 0.05 in seed 1.
    slopes = {0: {"sigmoid": -0.5, "linear": -0.1}, 1: {"sigmoid": -0.55, "linear": -0.5}}
    paths = []
    for seed, by_kind in slopes.items():
        path = tmp_path / f"seed{seed}.jsonl"
        rows = [r for kind, s in by_kind.items() for r in fake_fits(seed, kind, s)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    argv = ["--kinds", "sigmoid,linear", "--plot", str(tmp_path / "p.png")]
    for path in paths:
        argv += ["--from-raw", str(path)]
    assert main(argv) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    per_seed = {(o["seed"], o["kind"]): o for o in out if o["figure"] == "seed002_rates"}
    assert per_seed[(0, "linear")]["slope_median"] == pytest.approx(-0.1, abs=1e-3)
    assert per_seed[(1, "linear")]["met"] is False
    seeds = {o["kind"]: o for o in out if o["figure"] == "seed002_rates_seeds"}
    assert seeds["sigmoid"]["seeds_met"] == "2/2" and seeds["sigmoid"]["met_in_every_seed"]
    assert seeds["linear"]["seeds_met"] == "1/2" and not seeds["linear"]["met_in_every_seed"]
    assert seeds["linear"]["slopes_median"] == pytest.approx([-0.1, -0.5], abs=1e-3)
    assert (tmp_path / "p.png").stat().st_size > 0
