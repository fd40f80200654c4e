"""The Voronoi losses and the least-squares fit behind benchmarks/seed002_rates.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.seed002_moe import KINDS, fit_one, regression, true_params, voronoi_loss
from benchmarks.seed002_rates import resume_from

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
