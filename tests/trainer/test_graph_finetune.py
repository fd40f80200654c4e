"""Per-node fine-tune of a graph store, the rest of the graph frozen (`--graph-finetune-epochs`):
it never raises the training loss it optimises, and Ray tasks and the local executor agree."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from graph_support import tiny_graph_store

from experts_store import Store
from server._cli import main
from trainer.graph import finetune_nodes, graph_dataset, training_loss

pytestmark = pytest.mark.ray


@pytest.mark.usefixtures("ray_session")
def test_finetune_never_raises_the_training_loss_and_ray_equals_local(tmp_path: Path) -> None:
    model = tiny_graph_store(tmp_path / "store")
    x, y, _ = graph_dataset("tree8", 512, 0)
    before = training_loss(model, x, y)
    local, on_ray = copy.deepcopy(model), copy.deepcopy(model)
    options = {"epochs": 2, "lr": 1e-3, "batch_size": 128, "seed": 3}
    got_local = finetune_nodes(local, x, y, executor="local", **options)
    got_ray = finetune_nodes(on_ray, x, y, executor="ray", **options)
    # The same seed gives the same experts bit for bit, whichever executor ran the jobs.
    for (name, a), b in zip(local.state_dict().items(), on_ray.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert got_local.kept == got_ray.kept and got_local.after == got_ray.after
    assert got_local.before == pytest.approx(before, rel=0, abs=0)
    assert training_loss(local, x, y) == got_local.after <= before
    # Each node's own job keeps its best state, its start included: never above its start.
    assert set(got_local.node_losses) == {n.name for n in model.spec.nodes}
    assert all(after <= start for start, after in got_local.node_losses.values())
    # Prototypes (hence every route) are untouched: only experts move.
    for node in model.spec.nodes:
        assert torch.equal(local.node(node.name).prototypes, model.node(node.name).prototypes)


def test_build_with_finetune_reports_it_and_refuses_a_bad_epoch_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "store"
    common = ["build", "--kind", "graph", "--dataset", "tree8", "--samples", "300",
              "--epochs", "1", "--experts", "2", "--no-progress", "--executor", "local"]
    assert main([*common, "--out", str(out), "--graph-finetune-epochs", "-1"]) == 2
    assert "--graph-finetune-epochs" in capsys.readouterr().err
    assert main([*common, "--out", str(out), "--graph-finetune-epochs", "1"]) == 0
    report = Store.open(out).report()
    assert report is not None
    finetune = report["finetune"]
    assert finetune["epochs"] == 1 and finetune["executor"] == "local"
    assert finetune["train_loss"]["after"] <= finetune["train_loss"]["before"]
    assert report["mixture"]["value"] == finetune["test_mse"]["after"]
    assert main(["build", "--dataset", "ackley2d", "--out", str(tmp_path / "m"),
                 "--graph-finetune-epochs", "1"]) == 2
    assert "--graph-finetune-epochs does not apply to --kind momlp" in capsys.readouterr().err
