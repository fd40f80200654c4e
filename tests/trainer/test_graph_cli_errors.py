"""`momlp build --kind graph` refuses what it cannot train before training: bad options, a
spec the data cannot train (outputs not as wide as y, more experts than rows) and data files
it cannot read, each as one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server._cli import main
from trainer import ConfigError
from trainer.graph import (
    GraphBuildConfig,
    GraphSpec,
    GraphTraining,
    OutputWidthMismatch,
    TooManyExperts,
    build_graph_store,
)

pytestmark = pytest.mark.unit

TREE4: dict[str, Any] = {"nodes": [
    {"name": "a", "inputs": ["x:0", "x:1"], "widths": [2, 4, 1], "experts": 2},
    {"name": "b", "inputs": ["x:2", "x:3"], "widths": [2, 4, 1], "experts": 2},
    {"name": "root", "inputs": ["a", "b"], "widths": [2, 4, 1], "experts": 2}],
    "outputs": ["root"]}


@pytest.fixture(autouse=True)
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build here must be refused before it trains anything."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr("trainer.graph._publish.train_end_to_end", refuse)
    monkeypatch.setattr("trainer.graph._publish.train_nodewise", refuse)


def spec_file(tmp_path: Path, spec: dict[str, Any] = TREE4, **changes: Any) -> Path:
    spec = json.loads(json.dumps(spec))
    for entry in spec["nodes"]:
        entry.update(changes.get(entry["name"], {}))
    if "outputs" in changes:
        spec["outputs"] = changes["outputs"]
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def data_file(tmp_path: Path, rows: int = 60, **arrays: Any) -> Path:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (rows, 4))
    contents: dict[str, Any] = {"X": x, "y": np.tanh(x[:, 0] * x[:, 1])}
    contents.update(arrays)
    path = tmp_path / "data.npz"
    np.savez(path, **contents)
    return path


def refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str
) -> str:
    """Run the build; assert exit 2, one stderr line, no store; return that line."""
    out = tmp_path / "store"
    code = main(["build", "--kind", "graph", "--out", str(out), "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("momlp build: "), err
    assert not out.exists()
    return err


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--lr", "-1", "--lr: must be a positive number"),
        ("--lr", "0", "--lr: must be a positive number"),
        ("--prototype-lr", "0", "--prototype-lr: must be a positive number"),
        ("--batch-size", "0", "--batch-size: must be at least 1, got 0"),
        ("--epochs", "-1", "--epochs: must not be negative, got -1"),
        ("--prototype-epochs", "-1", "--prototype-epochs: must not be negative"),
        ("--experts", "0", "--experts: must be at least 1, got 0"),
        ("--width", "0", "--width: must be at least 1, got 0"),
        ("--branching", "1", "--branching: must be at least 2, got 1"),
        ("--test-fraction", "0", "--test-fraction: must lie in (0, 1), got 0.0"),
        ("--test-fraction", "1.5", "--test-fraction: must lie in (0, 1), got 1.5"),
        ("--samples", "0", "--samples: must be in [16, 10000000], got 0"),
        ("--graph-finetune-epochs", "-1", "--graph-finetune-epochs: must be in [0, 10000]"),
        ("--seed", str(2**32), "--seed: must be in [0, 4294967295]"),
    ],
)
def test_an_option_out_of_range_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, says: str
) -> None:
    err = refused(tmp_path, capsys, "--dataset", "tree8", "--samples", "64", option, value)
    assert says in err


def test_a_negative_seed_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code: object
    try:
        code = main(["build", "--kind", "graph", "--dataset", "tree8", "--seed", "-1",
                     "--out", str(tmp_path / "store"), "--no-progress"])
    except SystemExit as exit_:  # the parser may refuse it first
        code = exit_.code
    assert code == 2
    assert "--seed" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--seed: must be in"):
        build_graph_store(GraphBuildConfig(out=tmp_path / "s", dataset="tree8", samples=64,
                                           settings=GraphTraining(seed=-1)), progress=False)


def test_tree_shape_options_with_a_spec_file_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(tmp_path, capsys, "--graph", str(spec_file(tmp_path)), "--data",
                  str(data_file(tmp_path)), "--experts", "3")
    assert "--experts: shapes the tree8/tree16 graph" in err


def test_outputs_wider_than_y_are_refused_naming_the_node_and_both_widths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = spec_file(tmp_path, root={"widths": [2, 4, 2]})
    err = refused(tmp_path, capsys, "--graph", str(spec), "--data", str(data_file(tmp_path)))
    assert "node 'root': its output is 2 columns wide but y has 1 column" in err
    with pytest.raises(OutputWidthMismatch) as caught:
        build_graph_store(GraphBuildConfig(
            out=tmp_path / "s", spec=GraphSpec.from_dict(json.loads(spec.read_text())),
            data=data_file(tmp_path)), progress=False)
    assert (caught.value.node, caught.value.width, caught.value.columns) == ("root", 2, 1)


def test_several_outputs_are_counted_together_against_y(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = spec_file(tmp_path, outputs=["root", "a"])
    err = refused(tmp_path, capsys, "--graph", str(spec), "--data", str(data_file(tmp_path)))
    assert "graph: the outputs root, a are 2 columns wide but y has 1 column" in err


def test_a_nodewise_target_not_as_wide_as_its_node_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = data_file(tmp_path, t_a=np.zeros((60, 2)), t_b=np.zeros(60), t_root=np.zeros(60))
    err = refused(tmp_path, capsys, "--graph", str(spec_file(tmp_path)), "--data", str(data),
                  "--graph-training", "nodewise")
    assert "node 'a': its output is 1 column wide but t_a has 2 columns" in err


def test_a_node_with_more_experts_than_training_rows_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = spec_file(tmp_path, b={"experts": 1000})
    err = refused(tmp_path, capsys, "--graph", str(spec), "--data", str(data_file(tmp_path)))
    assert "node 'b': has 1000 experts" in err and "48 training rows" in err
    with pytest.raises(TooManyExperts):
        build_graph_store(GraphBuildConfig(
            out=tmp_path / "s", spec=GraphSpec.from_dict(json.loads(spec.read_text())),
            data=data_file(tmp_path)), progress=False)


@pytest.mark.parametrize(
    ("arrays", "says"),
    [
        ({"X": np.zeros((0, 4)), "y": np.zeros(0)}, "X must be 2-D [rows, features]"),
        ({"X": np.zeros((1, 4)), "y": np.zeros(1)}, "has 1 row; holding out the test fraction"),
        ({"X": np.zeros((60, 4)), "y": np.float64(1.0)}, "y must be [60] or [60, columns]"),
        ({"X": np.zeros((60, 4))}, "the archive needs arrays X and y"),
        ({"X": np.full((60, 4), 1e300), "y": np.zeros(60)}, "X holds values beyond float32"),
        ({"X": np.zeros((60, 4)), "y": np.full(60, 1e39)}, "y holds values beyond float32"),
        ({"X": np.zeros((60, 4)), "y": np.full(60, np.nan)}, "y holds NaN or infinite"),
        ({"X": np.full((60, 4), "a"), "y": np.zeros(60)}, "X must be numbers"),
    ],
)
def test_data_that_cannot_be_trained_on_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arrays: dict[str, Any], says: str
) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    err = refused(tmp_path, capsys, "--graph", str(spec_file(tmp_path)), "--data", str(path))
    assert f"{path}: {says}" in err


def test_a_nodewise_target_beyond_float32_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = data_file(tmp_path, t_a=np.full(60, 1e39), t_b=np.zeros(60), t_root=np.zeros(60))
    err = refused(tmp_path, capsys, "--graph", str(spec_file(tmp_path)), "--data", str(data),
                  "--graph-training", "nodewise")
    assert "t_a holds values beyond float32's range" in err


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def _npz_bytes(**arrays: Any) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _npy_bytes(array: Any) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


GOOD = _npz_bytes(X=np.zeros((60, 4)), y=np.zeros(60))


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "cannot read the archive"),
        (GOOD[: len(GOOD) // 2], "cannot read the archive"),
        (_zip({"X.npy": b"notanpy", "y.npy": b"notanpy"}), "member X is not an .npy array"),
        (_zip({"X": b"1,2", "y": b"3"}), "member X is not an .npy array"),
        (_npy_bytes(np.zeros((60, 4))), "holds one array (np.save), not an .npz archive"),
        (_npz_bytes(X=np.array([{"a": 1}], dtype=object), y=np.zeros(1)),
         "cannot read the archive"),
    ],
    ids=["empty", "truncated", "bad-npy-members", "non-npy-members", "one-array", "pickled"],
)
def test_an_unreadable_archive_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, says: str
) -> None:
    path = tmp_path / "data.npz"
    path.write_bytes(content)
    err = refused(tmp_path, capsys, "--graph", str(spec_file(tmp_path)), "--data", str(path))
    assert f"{path}: {says}" in err


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("latin-1", "cannot read the graph spec: 'utf-8' codec can't decode"),
        ("nested", "cannot read the graph spec: JSON nested too deeply"),
        ("fifo", "is not a regular file"),  # its read blocked the build for good
        ("huge widths", "node 'a': widths [2, 10000000, 10000000, 1] make experts of"),
    ],
)
def test_a_spec_file_that_cannot_be_a_spec_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, says: str
) -> None:
    import os

    path = tmp_path / "spec.json"
    if case == "latin-1":
        path.write_bytes('{"nodes": [{"name": "é"}]}'.encode("latin-1"))
    elif case == "nested":
        path.write_text("[" * 100_000)
    elif case == "fifo":
        os.mkfifo(path)
    else:
        spec_file(tmp_path, a={"widths": [2, 10_000_000, 10_000_000, 1]})
    err = refused(tmp_path, capsys, "--graph", str(path), "--data", str(data_file(tmp_path)))
    assert says in err, err
