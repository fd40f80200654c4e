from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from experts_store import ExpertArch, ExpertMLP, load_expert
from trainer._tasks import ExpertJob, TrainSpec, baseline_job, expert_job, validation_split

pytestmark = pytest.mark.unit

SPEC = TrainSpec(
    task="regression", loss="mse", num_classes=0, epochs=0, lr=1e-3, batch_size=16,
    optimizer="adam", seed=0,
)


def _job(tmp_path: Path, **changes: object) -> ExpertJob:
    fields: dict[str, object] = {
        "expert_id": 3,
        "out_path": str(tmp_path / "3.safetensors"),
        "small_arch": ExpertArch(widths=(2, 8, 1)).to_json(),
        "extra_layers": 2,
        "warmup_epochs": 0,
        "noise_std": 0.0,
        "spec": SPEC,
    }
    fields.update(changes)
    return ExpertJob(**fields)  # type: ignore[arg-type]


def test_deepened_expert_starts_as_the_small_network_it_was_given(tmp_path: Path) -> None:
    small = ExpertMLP(ExpertArch(widths=(2, 8, 1)), generator=torch.Generator().manual_seed(5))
    state = {k: v.numpy().copy() for k, v in small.state_dict().items()}
    x = np.random.default_rng(0).uniform(-1, 1, (20, 2)).astype(np.float32)
    metrics = expert_job(_job(tmp_path, initial_state=state), x, np.zeros((20, 1), np.float32))
    expert = load_expert(tmp_path / "3.safetensors", expected_sha256=metrics["sha256"])
    assert expert.arch.widths == (2, 8, 8, 8, 1)
    assert metrics["train_samples"] == 20 and metrics["expert_id"] == 3
    with torch.no_grad():
        # Identity layers (noise 0) and no training: the same function as the small network.
        torch.testing.assert_close(expert(torch.tensor(x)), small.eval()(torch.tensor(x)))


def test_expert_trains_on_its_cell_and_writes_its_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (200, 2)).astype(np.float32)
    y = (x[:, :1] * 2 - x[:, 1:]).astype(np.float32)
    spec = TrainSpec(**{**SPEC.__dict__, "epochs": 40, "lr": 1e-2})
    metrics = expert_job(_job(tmp_path, spec=spec, warmup_epochs=5, noise_std=1e-3), x, y)
    expert = load_expert(tmp_path / "3.safetensors")
    with torch.no_grad():
        mse = float(((expert(torch.tensor(x)) - torch.tensor(y)) ** 2).mean())
    assert mse < 0.01
    # The report's train figure is this one: the finished expert on its cell, raw units.
    assert metrics["train_metric"] == pytest.approx(mse, rel=1e-5)
    assert metrics["final_loss"] < 0.02
    assert metrics["params"] == expert.num_parameters()


def test_baseline_reports_test_accuracy_without_returning_weights() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 2)).astype(np.float32)
    labels = (x[:, 0] > 0).astype(np.int64)
    spec = TrainSpec(
        task="classification", loss="ce", num_classes=2, epochs=20, lr=1e-2, batch_size=32,
        optimizer="adamw", seed=0,
    )
    arch = ExpertArch(widths=(2, 16, 16, 2), batchnorm=True).to_json()
    result = baseline_job(arch, spec, x[:200], labels[:200], x[200:], labels[200:])
    assert result["metric"] == "accuracy" and result["value"] > 0.9
    assert set(result) >= {"params", "bytes", "train_seconds", "final_loss"}


def test_validation_split_holds_out_a_seeded_fraction_of_the_rows() -> None:
    spec = TrainSpec(**{**SPEC.__dict__, "select_epoch": "best-validation",
                        "validation_fraction": 0.25, "seed": 7})
    fit, held = validation_split(40, spec, salt=3)
    assert len(held) == 10 and len(fit) == 30
    assert sorted({*fit.tolist(), *held.tolist()}) == list(range(40))
    again, held_again = validation_split(40, spec, salt=3)
    assert held_again.tolist() == held.tolist()
    assert validation_split(40, spec, salt=4)[1].tolist() != held.tolist()
    # One row cannot be split; "last" trains on everything.
    assert validation_split(1, spec, salt=3)[1].size == 0
    assert validation_split(40, SPEC, salt=3)[1].size == 0


def test_best_validation_expert_reports_its_held_out_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (200, 2)).astype(np.float32)
    y = (x[:, :1] * 2 - x[:, 1:] + 0.05 * rng.normal(size=(200, 1))).astype(np.float32)
    spec = TrainSpec(**{**SPEC.__dict__, "epochs": 30, "lr": 1e-2,
                        "select_epoch": "best-validation"})
    metrics = expert_job(_job(tmp_path, spec=spec, warmup_epochs=5), x, y)
    fit, held = validation_split(200, spec, salt=3)
    expert = load_expert(tmp_path / "3.safetensors", expected_sha256=metrics["sha256"])

    def mse(rows: np.ndarray) -> float:
        with torch.no_grad():
            out = expert(torch.tensor(x[rows])).double()
        return float(((out - torch.tensor(y[rows]).double()) ** 2).mean())

    assert metrics["train_samples"] == 200 and metrics["validation_samples"] == 20
    assert metrics["train_metric"] == pytest.approx(mse(fit), rel=1e-5)
    assert metrics["validation_metric"] == pytest.approx(mse(held), rel=1e-5)
    assert 0 <= metrics["best_epoch"] <= 30
