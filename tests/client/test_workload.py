"""The workload's law, its prototype spacing estimate and its redraw of empty experts."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from client import Distribution, Workload, expert_law
from client import _workload as workload_module

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("uniform", Distribution("uniform")),
        ("cluster", Distribution("cluster")),
        ("zipf:1.1", Distribution("zipf", 1.1)),
        (" zipf:0 ", Distribution("zipf", 0.0)),
    ],
)
def test_parse_distribution(text, expected):
    assert Distribution.parse(text) == expected
    assert Distribution.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["zipf", "zipf:-1", "zipf:x", "zipf:nan", "uniform:2", "pareto"])
def test_parse_rejects(text):
    with pytest.raises(ValueError):
        Distribution.parse(text)


def test_zipf_law_is_normalised_power_law():
    law = expert_law(Distribution("zipf", 1.5), 10)
    assert sum(law) == pytest.approx(1.0)
    for rank in range(1, 10):
        assert law[rank] / law[0] == pytest.approx(1.0 / (rank + 1) ** 1.5)
    assert expert_law(Distribution("uniform"), 4) == [0.25] * 4


def test_rows_follow_the_law_over_the_seeded_ranking():
    pools = {expert: [[float(expert)]] for expert in range(8)}
    workload = Workload(
        distribution=Distribution("zipf", 1.0),
        num_experts=8,
        pools=pools,
        prototypes=None,
        noise_std=0.1,
        seed=11,
    )
    counts = Counter(int(row[0]) for row in workload.next_request(20000))
    law = expert_law(Distribution("zipf", 1.0), 8)
    for rank, expert in enumerate(workload.ranking):
        assert counts[expert] / 20000 == pytest.approx(law[rank], abs=0.012)
    assert sorted(workload.ranking) == list(range(8))


def test_experts_without_inputs_are_redrawn_and_the_law_renormalised():
    pools = {0: [[0.0]], 1: [], 2: [[2.0]]}
    workload = Workload(
        distribution=Distribution("uniform"),
        num_experts=3,
        pools=pools,
        prototypes=None,
        noise_std=0.1,
        seed=0,
    )
    counts = Counter(int(row[0]) for row in workload.next_request(4000))
    assert set(counts) == {0, 2}
    assert counts[0] / 4000 == pytest.approx(0.5, abs=0.03)
    assert workload.expected_frequencies() == {0: 0.5, 2: 0.5}


@pytest.mark.parametrize("with_numpy", [True, False])
def test_spacing_of_a_grid_is_its_step(monkeypatch, with_numpy):
    if not with_numpy:
        monkeypatch.setattr(workload_module, "numpy_or_none", lambda: None)
    grid = [[0.5 * i, 0.5 * j, 1.0] for i in range(6) for j in range(6)]
    spacing = workload_module.nearest_prototype_spacing(grid, random.Random(0))
    assert spacing == pytest.approx(0.5)
