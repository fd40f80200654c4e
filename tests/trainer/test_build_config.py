from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from experts_store import ExpertArch
from trainer import BuildConfig, ConfigError, baseline_arch, baseline_width, quick_demo_config

pytestmark = pytest.mark.unit


def test_paper_defaults_per_task() -> None:
    config = BuildConfig(out=Path("s"), dataset="ackley2d")
    reg = config.resolve("regression")
    assert (reg.depth, reg.lr, reg.optimizer, reg.loss, reg.batchnorm) == (
        3, 1e-4, "adam", "mse", False
    )
    cls = config.resolve("classification")
    assert (cls.depth, cls.lr, cls.optimizer, cls.loss, cls.batchnorm) == (
        4, 1e-3, "adamw", "ce", True
    )
    assert config.width == 1000


def test_quick_demo_is_2d_ackley_with_16_experts() -> None:
    config = quick_demo_config(Path("demo"))
    assert (config.dataset, config.experts, config.branching, config.quick) == (
        "ackley2d", 16, 4, True
    )
    assert config.out == Path("demo")
    config.validate()


@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({"dataset": None}, "dataset"),
        ({"data": Path("x.npz")}, "dataset"),
        ({"dataset": "mnist"}, "dataset"),
        ({"experts": 0}, "experts"),
        ({"branching": 1}, "branching"),
        ({"depth": 0}, "depth"),
        ({"lr": -1.0}, "lr"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"crash_once_expert": 99}, "crash_once_expert"),
        ({"select_epoch": "best"}, "select_epoch"),
        ({"validation_fraction": 0.0}, "validation_fraction"),
    ],
)
def test_contradictory_options_are_refused_with_the_option_named(
    changes: dict[str, object], option: str
) -> None:
    config = replace(BuildConfig(out=Path("s"), dataset="ackley2d"), **changes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert info.value.option == option
    assert f"--{option.replace('_', '-')}" in str(info.value)


def test_loss_must_fit_the_task() -> None:
    with pytest.raises(ConfigError, match="classification"):
        BuildConfig(out=Path("s"), dataset="digits", loss="mse").resolve("classification")


def test_baseline_matches_the_experts_hidden_parameter_count() -> None:
    assert baseline_width(1000, 4) == 2000
    arch = baseline_arch(2, 1, width=100, depth=3, num_experts=4, batchnorm=False)
    expert = ExpertArch(widths=(2, 100, 100, 100, 1))

    def hidden_weights(a: ExpertArch) -> int:
        return sum(i * o for i, o in zip(a.widths[1:-1], a.widths[2:-1], strict=False))

    # D.3.2: width w·√K makes the w×w hidden matrices total K experts' worth.
    assert hidden_weights(arch) == 4 * hidden_weights(expert)
    assert arch.widths == (2, 200, 200, 200, 1)
