"""`momlp build --kind hyper`: data and options it cannot train on are one-line refusals with
exit 2, before any training and without a store, for both condition sources."""

from __future__ import annotations

import json
import math
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server._cli import main
from trainer.hyper import HyperBuildConfig, HyperConfigError, PrototypeBuildConfig, load_npz_triples

pytestmark = pytest.mark.unit

ROWS = 40


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 3)).astype(np.float32)
    cond = rng.normal(size=(ROWS, 2)).astype(np.float32)
    return {"X": x, "I": cond, "y": (x[:, :2] * cond).sum(axis=1)}


def _npz(path: Path, **replace: Any) -> Path:
    np.savez(path, **(_arrays() | replace))
    return path


def _refused(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `momlp build ARGS --out OUT`; assert exit 2, no store, a one-line error; return it."""
    assert main(["build", *args, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("momlp build: ") and "\n" not in err and "Traceback" not in err
    assert not out.exists()
    return err


def _hyper(data: Path, *extra: str) -> list[str]:
    return ["--kind", "hyper", "--data", str(data), "--quick", *extra]


def _prototype(*extra: str) -> list[str]:
    return ["--kind", "hyper", "--condition-source", "prototype", "--experts", "4", "--quick",
            *extra]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_y_is_refused(
    bad: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    y = _arrays()["y"]
    y[3] = bad
    err = _refused(_hyper(_npz(tmp_path / "d.npz", y=y)), tmp_path / "s", capsys)
    assert "y holds NaN or infinite values in 1 rows (first: row 3)" in err


@pytest.mark.parametrize(
    ("name", "scale"), [("X", 1e39), ("X", 1e300), ("I", 1e39), ("y", 1e300)]
)
def test_values_beyond_float32_are_refused(
    name: str, scale: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Finite in float64, inf once cast to the float32 training runs on: NaN metrics before.
    values = _arrays()[name].astype(np.float64) * scale
    err = _refused(_hyper(_npz(tmp_path / "d.npz", **{name: values})), tmp_path / "s", capsys)
    assert f"{name} holds values beyond float32's range" in err


def test_integer_y_must_be_one_label_per_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two_labels = np.zeros((ROWS, 2), dtype=np.int64)
    two_labels[::2] = 1
    err = _refused(_hyper(_npz(tmp_path / "d.npz", y=two_labels)), tmp_path / "s", capsys)
    assert f"need y [{ROWS}] or [{ROWS}, 1], got [{ROWS}, 2]" in err


def test_a_column_of_labels_is_one_label_per_row(tmp_path: Path) -> None:
    labels = np.arange(ROWS, dtype=np.int64) % 3
    data = load_npz_triples(_npz(tmp_path / "d.npz", y=labels[:, None]), 0.25, seed=0)
    assert data.task == "classification" and data.output_dim == 3
    assert data.y_train.shape == (ROWS - 10,) and data.y_test.shape == (10,)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (np.arange(ROWS) % 3 - 1, "class labels must be >= 0, got -1 (first: row 0)"),
        (np.zeros(ROWS, dtype=np.int64), "classification needs at least 2 classes"),
        # 10**9 sized the output layer: killed for memory, no error.
        (np.arange(ROWS) % 2 * 10**9, "largest, 1000000000 (row 1), asks for 1000000001 units"),
    ],
)
def test_labels_that_cannot_train_a_classifier_are_refused(
    labels: np.ndarray, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(_hyper(_npz(tmp_path / "d.npz", y=labels)), tmp_path / "s", capsys)
    assert message in err


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("X", np.full((ROWS, 3), "a")),
        ("y", np.array(["a", "b"] * (ROWS // 2))),
        ("I", np.ones((ROWS, 2), dtype=np.complex64)),
    ],
)
def test_arrays_that_are_not_real_numbers_are_refused(
    name: str, values: np.ndarray, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(_hyper(_npz(tmp_path / "d.npz", **{name: values})), tmp_path / "s", capsys)
    assert f"{name} must be numbers (bool, int or float), got dtype {values.dtype}" in err


def test_y_of_more_than_two_dimensions_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    y = _arrays()["y"].reshape(ROWS, 1, 1)
    err = _refused(_hyper(_npz(tmp_path / "d.npz", y=y)), tmp_path / "s", capsys)
    assert f"regression y must be [{ROWS}] or [{ROWS}, out]" in err


def _unreadable(kind: str, path: Path) -> Path:
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        whole = _npz(path.with_name("whole.npz")).read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    elif kind == "members":
        with zipfile.ZipFile(path, "w") as archive:
            for name in ("X", "I", "y"):
                archive.writestr(f"{name}.npy", "not an array")
    else:
        np.save(path.with_name("one.npy"), _arrays()["X"])
        path.with_name("one.npy").rename(path)
    return path


@pytest.mark.parametrize("kind", ["empty", "truncated", "members", "one-array"])
@pytest.mark.parametrize("source", ["request", "prototype"])
def test_an_unreadable_npz_is_named(
    kind: str, source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _unreadable(kind, tmp_path / "bad.npz")
    args = _hyper(data) if source == "request" else _prototype("--data", str(data))
    err = _refused(args, tmp_path / "s", capsys)
    assert str(data) in err


@pytest.mark.parametrize("name", ["triples.npz", "triples.csv"])
def test_a_data_path_that_is_no_regular_file_is_named_as_such(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A FIFO was "cannot read the archive: ... is not a regular file", as if a damaged zip.
    fifo = tmp_path / name
    os.mkfifo(fifo)
    err = _refused(_hyper(fifo), tmp_path / "s", capsys)
    assert f"{fifo}: not a regular file" in err and "archive" not in err


@pytest.mark.parametrize("fraction", ["1.5", "1", "0", "-0.2", "nan"])
@pytest.mark.parametrize("source", ["request", "prototype"])
def test_a_test_fraction_outside_0_1_is_refused(
    fraction: str, source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ("--test-fraction", fraction)
    args = (_hyper(_npz(tmp_path / "d.npz"), *extra) if source == "request"
            else _prototype("--dataset", "ackley2d", "--grid-size", "10", *extra))
    err = _refused(args, tmp_path / "s", capsys)
    assert "test_fraction: must lie in (0, 1)" in err


def test_a_test_fraction_that_leaves_no_training_row_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two_rows = {k: v[:2] for k, v in _arrays().items()}
    err = _refused(_hyper(_npz(tmp_path / "d.npz", **two_rows), "--test-fraction", "0.9"),
                   tmp_path / "s", capsys)
    assert "2 rows leave no training rows" in err


@pytest.mark.parametrize("source", ["request", "prototype"])
def test_a_seed_torch_cannot_take_is_refused(
    source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ("--seed", str(2**64))
    args = (_hyper(_npz(tmp_path / "d.npz"), *extra) if source == "request"
            else _prototype("--dataset", "ackley2d", "--grid-size", "10", *extra))
    assert "seed: must be in [0, 18446744073709551615]" in _refused(args, tmp_path / "s", capsys)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_configs_refuse_a_seed_out_of_range(seed: int, tmp_path: Path) -> None:
    with pytest.raises(HyperConfigError, match="seed: must be in"):
        HyperBuildConfig(out=tmp_path, data=tmp_path / "d.npz", seed=seed)
    with pytest.raises(HyperConfigError, match="seed: must be in"):
        PrototypeBuildConfig(out=tmp_path, dataset="ackley2d", seed=seed)


@pytest.mark.parametrize("lr", ["nan", "inf"])
def test_a_learning_rate_that_is_not_a_positive_number_is_refused(
    lr: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(_hyper(_npz(tmp_path / "d.npz"), "--lr", lr), tmp_path / "s", capsys)
    assert "need lr > 0" in err and f"lr={lr}" in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--named-conditions", "3"), ("--baseline", "embedding"), ("--routing", "exact")],
)
def test_request_path_options_are_refused_with_prototype_conditions(
    flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _prototype("--dataset", "ackley2d", "--grid-size", "10", flag, value)
    err = _refused(args, tmp_path / "s", capsys)
    assert err == f"momlp build: {flag} does not apply to --condition-source prototype"


def _strict_json(line: str) -> dict[str, Any]:
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    summary: dict[str, Any] = json.loads(line, parse_constant=refuse)
    return summary


def test_prototype_conditions_read_a_table_through_its_target_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(60, 3))
    table = tmp_path / "rows.csv"
    lines = ["a,b,t"] + [f"{a},{b},{t}" for a, b, t in rows]
    table.write_text("\n".join(lines) + "\n")
    args = _prototype("--data", str(table), "--epochs", "1", "--test-fraction", "0.5")
    assert main(["build", *args, "--out", str(tmp_path / "s"), "--no-progress"]) == 2
    assert "a table needs --target COLUMN" in capsys.readouterr().err
    assert main(["build", *args, "--target", "t", "--out", str(tmp_path / "s"),
                 "--no-progress"]) == 0
    summary = _strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["condition_source"] == "prototype" and summary["experts"] == 4
    report = json.loads((tmp_path / "s" / "report.json").read_text())
    assert report["hypernetwork"]["metric"] == "mse"


def test_a_diverged_run_prints_json_with_null_for_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _hyper(_npz(tmp_path / "d.npz"), "--lr", "1e6", "--epochs", "1", "--depth", "1")
    assert main(["build", *args, "--out", str(tmp_path / "s"), "--no-progress"]) == 0
    summary = _strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["hypernetwork"]["value"] is None
