"""`momlp build --kind graph`: a bad graph refused before training naming the node; the
end-to-end and nodewise builds publish a graph store that serves what was trained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from experts_store import Store
from server._cli import main
from trainer.graph import GraphCycle, UndefinedInput, graph_dataset

pytestmark = pytest.mark.unit

TREE4 = {"nodes": [
    {"name": "a", "inputs": ["x:0", "x:1"], "widths": [2, 4, 1], "experts": 2},
    {"name": "b", "inputs": ["x:2", "x:3"], "widths": [2, 4, 1], "experts": 2},
    {"name": "root", "inputs": ["a", "b"], "widths": [2, 4, 1], "experts": 2}],
    "outputs": ["root"]}


def build(tmp_path: Path, spec: dict[str, object], *extra: str) -> int:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return main(["build", "--kind", "graph", "--graph", str(path), "--out",
                 str(tmp_path / "store"), "--epochs", "1", "--no-progress", *extra])


@pytest.mark.parametrize(
    ("change", "node", "error"),
    [({"a": ["x:0", "root"]}, "a", GraphCycle), ({"b": ["x:2", "c"]}, "b", UndefinedInput)],
)
def test_a_bad_graph_is_refused_before_training_naming_the_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, list[str]],
    node: str, error: type,
) -> None:
    spec = json.loads(json.dumps(TREE4))
    for entry in spec["nodes"]:
        entry["inputs"] = change.get(entry["name"], entry["inputs"])
    assert build(tmp_path, spec, "--dataset", "tree8", "--samples", "64") == 2
    assert f"node {node!r}" in capsys.readouterr().err
    assert not (tmp_path / "store" / "manifest.json").exists()
    from trainer.graph import GraphBuildConfig, GraphSpec, build_graph_store

    with pytest.raises(error):
        build_graph_store(GraphBuildConfig(out=tmp_path / "s2", spec=GraphSpec.from_dict(spec),
                                           dataset="tree8", samples=64), progress=False)


def test_nodewise_build_from_a_file_with_a_target_per_node(tmp_path: Path) -> None:
    x, y, nodes = graph_dataset("tree8", 400, seed=0)
    x4 = x[:, :4]
    a = torch.tanh(2 * x4[:, 0] * x4[:, 1] + x4[:, 0] - x4[:, 1])
    b = torch.tanh(2 * x4[:, 2] * x4[:, 3] + x4[:, 2] - x4[:, 3])
    root = torch.tanh(2 * a * b + a - b)
    data = tmp_path / "data.npz"
    np.savez(data, X=x4.numpy(), y=root.numpy(), t_a=a.numpy(), t_b=b.numpy(),
             t_root=root.numpy())
    assert build(tmp_path, TREE4, "--data", str(data), "--graph-training", "nodewise",
                 "--prototype-epochs", "1") == 0
    store = Store.open(tmp_path / "store")
    assert store.manifest.kind == "graph" and store.manifest.num_experts == 6
    assert store.verify() == []
    report = store.report()
    assert report is not None and report["training"] == "nodewise"


def test_graph_options_without_kind_graph_and_samples_out_of_range_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "store")
    assert main(["build", "--dataset", "tree8", "--out", out]) == 2
    assert "--kind graph" in capsys.readouterr().err
    assert main(["build", "--kind", "graph", "--dataset", "tree8", "--samples", "3",
                 "--out", out, "--no-progress"]) == 2
    assert "--samples" in capsys.readouterr().err
