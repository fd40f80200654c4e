from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer import (
    DataError,
    ackley,
    fbm_path,
    load_data_file,
    make_dataset,
    rastrigin,
    read_data_file,
    regular_grid,
)

pytestmark = pytest.mark.unit


def test_ackley_matches_eq_37_at_hand_computed_points() -> None:
    # At the origin: 20 + e − 20·e^0 − e^1 = 0.
    assert ackley(np.zeros((1, 2)))[0] == pytest.approx(0.0, abs=1e-12)
    # x = (1, 0): rms = sqrt(1/2), mean cos = (1 + 1)/2 = 1.
    expected = 20 + math.e - 20 * math.exp(-0.2 * math.sqrt(0.5)) - math.e
    assert ackley(np.array([[1.0, 0.0]]))[0] == pytest.approx(expected, rel=1e-12)
    # x = (0.5, 0.5, 0.5): rms = 0.5, mean cos = −1.
    expected = 20 + math.e - 20 * math.exp(-0.1) - math.exp(-1)
    assert ackley(np.full((1, 3), 0.5))[0] == pytest.approx(expected, rel=1e-12)


def test_rastrigin_matches_eq_38_at_hand_computed_points() -> None:
    assert rastrigin(np.zeros((1, 3)))[0] == pytest.approx(0.0, abs=1e-12)
    # Σx² = 0.5, Σcos(π) = −2 → 0.5 + 10·(2 + 2).
    assert rastrigin(np.array([[0.5, 0.5]]))[0] == pytest.approx(40.5, rel=1e-12)
    # Integer points: cos 2πx = 1, so only Σx² remains.
    assert rastrigin(np.array([[1.0, -1.0, 0.0]]))[0] == pytest.approx(2.0, abs=1e-9)


def test_regular_grid_has_s_to_the_n_vertices_covering_the_box() -> None:
    grid = regular_grid(5, 3, -1.0, 1.0)
    assert grid.shape == (125, 3)
    assert len({tuple(row) for row in grid}) == 125
    assert grid.min() == -1.0 and grid.max() == 1.0
    assert set(np.round(grid[:, 2], 6)) == {-1.0, -0.5, 0.0, 0.5, 1.0}


@pytest.mark.parametrize("hurst", [0.1, 0.25, 0.5, 0.75])
def test_fbm_variogram_recovers_the_hurst_exponent(hurst: float) -> None:
    estimates = []
    for seed in range(4):
        path = fbm_path(4001, hurst, np.random.default_rng(seed))
        lags = np.arange(1, 33)
        variogram = [np.mean((path[lag:] - path[:-lag]) ** 2) for lag in lags]
        # E|B(t+h) − B(t)|² = h^{2H}: the log-log slope is 2H.
        slope = np.polyfit(np.log(lags / 4000), np.log(variogram), 1)[0]
        estimates.append(slope / 2)
    assert np.mean(estimates) == pytest.approx(hurst, abs=0.04)


def test_fbm_has_unit_variance_at_one_and_starts_at_zero() -> None:
    ends = np.array([fbm_path(65, 0.3, np.random.default_rng(s))[-1] for s in range(3000)])
    assert fbm_path(65, 0.3, np.random.default_rng(0))[0] == 0.0
    assert np.var(ends) == pytest.approx(1.0, rel=0.1)


def test_fbm_is_seedable() -> None:
    a = fbm_path(100, 0.25, np.random.default_rng(7))
    b = fbm_path(100, 0.25, np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)


def test_synthetic_dataset_targets_follow_their_formula_and_split_80_20() -> None:
    data = make_dataset("rastrigin3d", grid_size=6, seed=3)
    assert data.x_train.shape == (173, 3) and data.x_test.shape == (43, 3)
    np.testing.assert_allclose(data.y_train[:, 0], rastrigin(data.x_train), rtol=1e-5, atol=1e-4)
    both = np.concatenate([data.x_train, data.x_test])
    assert len({tuple(r) for r in both}) == 216
    holder = make_dataset("holder1d", grid_size=500)
    assert holder.x_train.min() >= 0.0 and holder.x_train.max() <= 1.0
    assert holder.output_dim == 1 and holder.task == "regression"


def test_digits_is_a_ten_class_problem_scaled_to_unit_interval() -> None:
    data = make_dataset("digits")
    assert data.task == "classification" and data.num_classes == 10
    assert data.input_dim == 64 and data.x_train.max() <= 1.0
    assert len(data.x_train) + len(data.x_test) == 1797


def test_unknown_dataset_is_refused() -> None:
    with pytest.raises(DataError, match="unknown dataset"):
        make_dataset("mnist")


def test_npz_file_loads_and_bad_files_are_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    good = tmp_path / "good.npz"
    np.savez(good, X=rng.normal(size=(50, 3)), y=rng.normal(size=50))
    data = load_data_file(good)
    assert data.task == "regression" and data.input_dim == 3 and len(data.x_train) == 40
    # The same rows as `momlp loadtest --eval` reads them (x, y) give the same split.
    lower = tmp_path / "lower.npz"
    with np.load(good) as arrays:
        np.savez(lower, x=arrays["X"], y=arrays["y"])
    assert np.array_equal(load_data_file(lower).x_train, data.x_train)

    labels = tmp_path / "labels.npz"
    np.savez(labels, X=rng.normal(size=(30, 2)), y=np.array([3, 7] * 15))
    cls = load_data_file(labels)
    assert cls.task == "classification" and cls.classes == ["3", "7"]

    nan = tmp_path / "nan.npz"
    x = rng.normal(size=(20, 2))
    x[5, 1] = np.nan
    np.savez(nan, X=x, y=np.zeros(20))
    with pytest.raises(DataError, match="NaN"):
        load_data_file(nan)

    shapes = tmp_path / "shapes.npz"
    np.savez(shapes, X=rng.normal(size=(20, 2)), y=np.zeros(19))
    with pytest.raises(DataError, match="one row per row"):
        load_data_file(shapes)

    missing = tmp_path / "missing.npz"
    np.savez(missing, inputs=np.zeros((3, 2)))
    with pytest.raises(DataError, match="lacks"):
        load_data_file(missing)

    objects = tmp_path / "objects.npz"
    np.savez(objects, X=np.array([{"a": 1}] * 4, dtype=object), y=np.zeros(4))
    with pytest.raises(DataError):
        load_data_file(objects)

    unknown = tmp_path / "data.json"
    unknown.write_text("{}")
    with pytest.raises(DataError, match="unknown data file type"):
        load_data_file(unknown)


def test_csv_needs_a_target_column_and_numeric_inputs(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("a,b,label\n" + "".join(f"{i},{i * 2},{'cat' if i % 2 else 'dog'}\n"
                                            for i in range(20)))
    with pytest.raises(DataError, match="--target"):
        load_data_file(table)
    with pytest.raises(DataError, match="no column"):
        load_data_file(table, target="nope")
    data = load_data_file(table, target="label")
    assert data.task == "classification" and data.classes == ["cat", "dog"]
    assert data.input_dim == 2
    # Features and label stay paired through the split: odd a ⇔ cat.
    for row, label in zip(data.x_train, data.y_train, strict=True):
        assert (int(row[0]) % 2 == 1) == (label == 0)


def test_a_file_without_rows_is_refused_as_holding_none(tmp_path: Path) -> None:
    empty = tmp_path / "empty.npz"
    np.savez(empty, X=np.zeros((0, 3)), y=np.zeros(0))
    with pytest.raises(DataError, match="holds no rows"):
        load_data_file(empty)
    header_only = tmp_path / "header.csv"
    header_only.write_text("a,b,y\n")
    with pytest.raises(DataError, match="holds no rows"):
        load_data_file(header_only, target="y")


def test_a_table_without_pandas_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = tmp_path / "t.csv"
    table.write_text("a,y\n1,2\n3,4\n")
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` raises ImportError
    with pytest.raises(DataError, match=r"momlp\[tables\]"):
        load_data_file(table, target="y")


def test_parquet_regression_table(tmp_path: Path) -> None:
    import pandas as pd

    frame = pd.DataFrame({"u": np.linspace(0, 1, 25), "v": np.arange(25.0)})
    frame["target"] = frame["u"] * 3 + frame["v"]
    path = tmp_path / "t.parquet"
    frame.to_parquet(path)
    data = load_data_file(path, target="target")
    assert data.task == "regression" and data.input_dim == 2 and data.output_dim == 1
    np.testing.assert_allclose(
        data.y_train[:, 0], data.x_train[:, 0] * 3 + data.x_train[:, 1], rtol=1e-5
    )


def _lying_npz(path: Path) -> None:
    """An .npz of ~1 KB whose X header claims a [10^6, 10^6] float32 array (3.6 TiB)."""
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)}
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("X.npy", header.getvalue() + b"\0" * 64)
        buf = io.BytesIO()
        np.save(buf, np.zeros(3))
        archive.writestr("y.npy", buf.getvalue())


def test_files_that_are_not_data_are_refused_in_one_line(tmp_path: Path) -> None:
    import os

    x = np.random.default_rng(0).uniform(-1, 1, (40, 2))
    cases: dict[str, str] = {}
    np.savez(tmp_path / "complex.npz", X=x + 1j, y=x[:, 0])
    cases["complex.npz"] = "X is of dtype complex128, not real numbers"
    np.savez(tmp_path / "dates.npz", X=x, y=np.arange(40).astype("datetime64[D]"))
    cases["dates.npz"] = "y is of dtype datetime64[D], not real numbers"
    _lying_npz(tmp_path / "lying.npz")
    cases["lying.npz"] = "cannot read the archive: Unable to allocate 3.64 TiB"
    (tmp_path / "text.npz").write_text("a,b,t\n1,2,3\n")  # numpy: "allow_pickle=True"?
    cases["text.npz"] = "neither an .npz archive nor an .npy array of numbers"
    os.mkfifo(tmp_path / "fifo.npz")  # its read blocked the build for good
    cases["fifo.npz"] = "not a regular file"
    rows = "".join(f"{a},{b},{a + b},{a * b}\n" for a, b in x[:10])
    (tmp_path / "shifted.csv").write_text("a,b,t\n" + rows)  # one field more than the header
    cases["shifted.csv"] = "its rows have more fields than its header names"
    (tmp_path / "indexed.csv").write_text(
        ",a,b,t\n" + "".join(f"{i},{a},{b},{a + b}\n" for i, (a, b) in enumerate(x[:10]))
    )
    cases["indexed.csv"] = "columns without a name in the header ['Unnamed: 0']"
    for name, words in cases.items():
        with pytest.raises(DataError) as info:
            load_data_file(tmp_path / name, target="t")
        assert words in str(info.value), (name, str(info.value))
        assert "\n" not in str(info.value) and "allow_pickle" not in str(info.value)


def test_a_parquet_target_of_lists_or_times_is_no_class(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    frame = pd.DataFrame({"a": np.arange(12.0), "t": [[1.0, float(i % 2)] for i in range(12)]})
    frame.to_parquet(tmp_path / "lists.parquet")
    # str() of each list made a class of it, and the store was published.
    with pytest.raises(DataError, match="holds object values, neither numbers nor class names"):
        load_data_file(tmp_path / "lists.parquet", target="t")
    frame["t"] = pd.date_range("2020-01-01", periods=12)
    frame.to_parquet(tmp_path / "times.parquet")
    with pytest.raises(DataError, match="holds datetime64"):
        load_data_file(tmp_path / "times.parquet", target="t")


def test_fractional_labels_are_refused_as_classes_and_integral_floats_taken(
    tmp_path: Path,
) -> None:
    x = np.random.default_rng(3).normal(size=(30, 2))
    np.savez(tmp_path / "quantity.npz", X=x, y=np.linspace(0.0, 1.0, 30))
    fractional = r"y holds 28 fractional values \(first: 0\.0344828 in row 1\)"
    with pytest.raises(DataError, match=fractional):
        load_data_file(tmp_path / "quantity.npz", task="classification")  # 30 classes before
    np.savez(tmp_path / "labels.npz", X=x, y=np.array([0.0, 1.0, 2.0] * 10))
    data = load_data_file(tmp_path / "labels.npz", task="classification")
    assert data.classes == ["0.0", "1.0", "2.0"] and data.num_classes == 3


def test_read_data_file_keeps_every_row_in_order_and_needs_no_second_class(
    tmp_path: Path,
) -> None:
    x = np.random.default_rng(4).normal(size=(5, 2))
    np.savez(tmp_path / "one.npz", X=x, y=np.full(5, 7))
    rows = read_data_file(tmp_path / "one.npz", task="classification")
    assert rows.classes == ["7"] and rows.y.tolist() == [0] * 5
    assert np.array_equal(rows.x, x)
    with pytest.raises(DataError, match="at least 2 classes"):
        load_data_file(tmp_path / "one.npz", task="classification")
    np.savez(tmp_path / "single.npz", X=x[:1], y=np.ones(1))
    assert read_data_file(tmp_path / "single.npz").x.shape == (1, 2)
    with pytest.raises(DataError, match="too few to split"):
        load_data_file(tmp_path / "single.npz")


def _wide_csv(path: Path, x: np.ndarray, labels: list[str], at: int) -> None:
    """x's columns f0.. with a column t of `labels` inserted before column `at`."""
    names = [f"f{i}" for i in range(x.shape[1])]
    lines = [",".join([*names[:at], "t", *names[at:]])]
    for row, label in zip(x.tolist(), labels, strict=True):
        cells = [repr(v) for v in row]
        lines.append(",".join([*cells[:at], label, *cells[at:]]))
    path.write_text("\n".join(lines) + "\n")


def test_a_wide_csv_reads_every_column_in_its_place(tmp_path: Path) -> None:
    # Eighths print and parse exactly, so any reader must give back these very values.
    x = np.random.default_rng(5).integers(-8000, 8000, size=(4, 20_000)) / 8
    at = 12_345  # mid-table: the inputs after the target move up one
    _wide_csv(tmp_path / "named.csv", x, ["cat", "dog", "cat", "dog"], at)
    rows = read_data_file(tmp_path / "named.csv", target="t")
    assert rows.task == "classification" and rows.classes == ["cat", "dog"]
    assert rows.x.dtype == np.float64 and np.array_equal(rows.x, x)
    assert rows.y.tolist() == [0, 1, 0, 1]
    _wide_csv(tmp_path / "numbers.csv", x, ["0.5", "1.5", "-2", "4"], at)
    rows = read_data_file(tmp_path / "numbers.csv", target="t")
    assert rows.task == "regression" and np.array_equal(rows.x, x)
    assert rows.y.tolist() == [[0.5], [1.5], [-2.0], [4.0]]


def test_a_wide_csv_target_of_numbers_and_names_reads_as_class_names(tmp_path: Path) -> None:
    # pandas typed a wide file in pieces of 2**20 / width rows (32 at 20,000 columns): names
    # past the first piece made the target mixed objects (and a DtypeWarning), refused as
    # "neither numbers nor class names" where a narrow file read as classes.
    labels = [str(i % 3) for i in range(39)] + ["other"]
    _wide_csv(tmp_path / "mixed.csv", np.ones((40, 20_000)), labels, 20_000)
    rows = read_data_file(tmp_path / "mixed.csv", target="t")
    assert rows.task == "classification" and rows.classes == ["0", "1", "2", "other"]
    assert rows.y.tolist() == [i % 3 for i in range(39)] + [3]
    assert np.array_equal(rows.x, np.ones((40, 20_000)))


def test_a_wide_tables_errors_name_twenty_columns_and_count_the_rest(tmp_path: Path) -> None:
    # The whole header of a 20,000-column table was ~200 KB of message (3.6 MB at 300,000).
    x = np.ones((2, 20_000))
    _wide_csv(tmp_path / "wide.csv", x, ["a", "b"], 0)
    with pytest.raises(DataError) as caught:
        read_data_file(tmp_path / "wide.csv", target="nope")
    message = str(caught.value)
    assert "no column 'nope'" in message and "and 19981 more" in message
    assert len(message) < 1000, len(message)


def _long_csv(path: Path, cells: list[list[str]], line_break: str = "\n") -> None:
    """A 300-column CSV (f0..f298, then t) of `cells` rows, each row 299 inputs and a target."""
    header = ",".join([*(f"f{i}" for i in range(299)), "t"])
    path.write_bytes(line_break.join([header, *(",".join(row) for row in cells), ""]).encode())


def _rows_of_ones(count: int, labels: list[str]) -> list[list[str]]:
    return [["1"] * 299 + [label] for label in labels[:count]]


def test_a_long_csv_reads_a_target_of_numbers_and_names_as_a_short_one_does(
    tmp_path: Path,
) -> None:
    # 4,500 lines of 300 columns: pandas types them in pieces of 2,048 rows. The names in the
    # third piece made the numbers of the first two ints beside strings: the target was
    # refused as "neither numbers nor class names", where 20 lines of it read as classes.
    labels = [str(i % 3) for i in range(4500)]
    labels[4400] = "other"
    _long_csv(tmp_path / "long.csv", _rows_of_ones(4500, labels))
    _long_csv(tmp_path / "short.csv", _rows_of_ones(20, [*labels[:19], "other"]))
    long = read_data_file(tmp_path / "long.csv", target="t")
    short = read_data_file(tmp_path / "short.csv", target="t")
    assert long.task == short.task == "classification"
    assert long.classes == short.classes == ["0", "1", "2", "other"]
    assert long.y.tolist() == [3 if i == 4400 else i % 3 for i in range(4500)]
    assert np.array_equal(long.x, np.ones((4500, 299)))


def test_a_long_csv_input_with_a_stray_name_is_refused_by_name_as_a_short_one_is(
    tmp_path: Path,
) -> None:
    # The same pieces made f7 ints beside a string: pandas' DtypeWarning (advice no momlp user
    # can take) came before the refusal; under the suite's warnings-as-errors, instead of it.
    rows = _rows_of_ones(4500, [str(i % 2) for i in range(4500)])
    rows[4400][7] = "n/a?"
    _long_csv(tmp_path / "long.csv", rows)
    _long_csv(tmp_path / "short.csv", rows[4390:4410])
    for name in ("long.csv", "short.csv"):
        with pytest.raises(DataError, match=r"non-numeric input columns \['f7'\]$"):
            read_data_file(tmp_path / name, target="t")


def test_a_csv_of_lone_cr_line_breaks_reads_as_its_lf_twin_in_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pandas takes a lone CR (classic Mac) as a line break, but the line count that picks
    # how to parse saw none: a long file of them was parsed whole, holding every cell's text
    # at once (one-off, a 480 MB file: 1.5 GB peak parsed whole, 1.0 GB read in pieces).
    import pandas as pd

    parses: list[bool] = []
    read_csv = pd.read_csv

    def recorded(path: Any, **options: Any) -> Any:
        if "usecols" not in options:
            parses.append(bool(options.get("low_memory", True)))
        return read_csv(path, **options)

    monkeypatch.setattr(pd, "read_csv", recorded)
    labels = ["cat" if i % 3 else "dog" for i in range(4500)]
    for rows in (20, 4500):
        got = []
        for name, line_break in (("lf", "\n"), ("cr", "\r"), ("crlf", "\r\n")):
            path = tmp_path / f"{name}-{rows}.csv"
            _long_csv(path, _rows_of_ones(rows, labels), line_break)
            got.append(read_data_file(path, target="t"))
        for table in got:
            # Lone CRs read correctly either way: pandas ends a line at any of the three.
            assert table.classes == ["cat", "dog"] and table.x.shape == (rows, 299)
            assert table.y.tolist() == [0 if i % 3 else 1 for i in range(rows)]
        # LF, CR, CRLF: each parsed as the LF file is (whole when short, in pieces when long).
        assert parses == [rows > 4000] * 3, (rows, parses)
        parses.clear()
