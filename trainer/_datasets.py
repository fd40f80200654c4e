"""The paper's datasets (Section 6.1, Appendix C and D.1), sklearn digits, and user files.

Every dataset comes back as a `Dataset` already split 80/20 at random (seeded) and
validated: finite numbers, 2-D inputs, one target row per input row.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from experts_store import file_problem

from ._arrays import FLOAT32_MAX, UNREADABLE_ARRAY_FILE, open_regular, unreadable_reason
from ._exceptions import DataError

__all__ = [
    "DATASET_NAMES",
    "Dataset",
    "Rows",
    "Task",
    "ackley",
    "fbm_path",
    "load_data_file",
    "make_dataset",
    "rastrigin",
    "read_data_file",
    "regular_grid",
]

# An integer target with more distinct values than this, read as classes by --task auto, gets a
# warning: it may well be a quantity (a price, a count).
_MANY_CLASSES = 20

# A CSV of fewer rows than this is parsed whole (low_memory=False). pandas' default parses it in
# pieces and pays a per-column cost for each: past 10 MB two parallel halves and a sample row,
# and below that, on a wide file, pieces of 2**20 / width rows (2 rows at 300,000 columns), each
# typed alone. A longer file keeps the default: its parallel read is the faster one.
_FEW_ROWS = 4000

logger = logging.getLogger(__name__)

Task = Literal["regression", "classification"]
FloatArray = npt.NDArray[np.float64]

DATASET_NAMES = ("holder1d", "ackley2d", "ackley3d", "rastrigin2d", "rastrigin3d", "digits")

# Section 6.1: s^n grid vertices, s = 10,000 (n=1), 150 (n=2), 30 (n=3).
_PAPER_GRID_SIZE = {1: 10_000, 2: 150, 3: 30}
DEFAULT_HURST = 0.25


@dataclass(frozen=True)
class Dataset:
    """A train/test split; classification targets are int64 class indices [N]."""

    name: str
    task: Task
    x_train: npt.NDArray[np.float32]
    y_train: npt.NDArray[np.float32] | npt.NDArray[np.int64]
    x_test: npt.NDArray[np.float32]
    y_test: npt.NDArray[np.float32] | npt.NDArray[np.int64]
    num_classes: int = 0
    classes: list[str] = field(default_factory=list)

    @property
    def input_dim(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def output_dim(self) -> int:
        if self.task == "classification":
            return self.num_classes
        return int(self.y_train.shape[1])

    @property
    def lower(self) -> npt.NDArray[np.float32]:
        return np.asarray(self.x_train.min(axis=0), dtype=np.float32)

    @property
    def upper(self) -> npt.NDArray[np.float32]:
        return np.asarray(self.x_train.max(axis=0), dtype=np.float32)


@dataclass(frozen=True)
class Rows:
    """A data file's checked rows, not split: x float64 [N, n]; y float64 [N, out]
    (regression) or int64 class indices [N] into `classes` (classification)."""

    source: str
    task: Task
    x: FloatArray
    y: FloatArray | npt.NDArray[np.int64]
    classes: list[str] = field(default_factory=list)


# Complex, datetime, timedelta and structured dtypes: numbers only by a cast that loses what
# they mean.
_NOT_REAL = "cmMV"


def ackley(x: npt.ArrayLike, a: float = 20.0, b: float = 0.2) -> FloatArray:
    """Eq. (37): 20 + e − a·exp(−b·sqrt(mean x²)) − exp(mean cos 2πx), over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    root_mean_square = np.sqrt(np.mean(x**2, axis=-1))
    mean_cos = np.mean(np.cos(2.0 * math.pi * x), axis=-1)
    return np.asarray(
        20.0 + math.e - a * np.exp(-b * root_mean_square) - np.exp(mean_cos), dtype=np.float64
    )


def rastrigin(x: npt.ArrayLike) -> FloatArray:
    """Eq. (38): Σ x² + 10 (n − Σ cos 2πx), over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    return np.asarray(
        np.sum(x**2, axis=-1) + 10.0 * (n - np.sum(np.cos(2.0 * math.pi * x), axis=-1)),
        dtype=np.float64,
    )


def regular_grid(points_per_axis: int, dim: int, low: float, high: float) -> FloatArray:
    """The s^n vertices of the regular grid on [low, high]^n, as rows [s^n, n]."""
    axis = np.linspace(low, high, points_per_axis)
    mesh = np.meshgrid(*([axis] * dim), indexing="ij")
    return np.stack([m.reshape(-1) for m in mesh], axis=1)


def fbm_path(num_points: int, hurst: float, rng: np.random.Generator) -> FloatArray:
    """Fractional Brownian motion B_H on the grid t_k = k/(num_points−1) of [0, 1], B_H(0) = 0.

    Exact in distribution (Davies-Harte circulant embedding of fractional Gaussian noise):
    Cov(B_H(t), B_H(u)) = (t^{2H} + u^{2H} − |t−u|^{2H}) / 2.
    """
    if not 0.0 < hurst < 1.0:
        raise ValueError(f"hurst must lie in (0, 1), got {hurst}")
    if num_points < 2:
        raise ValueError("an fBm path needs at least 2 points")
    steps = num_points - 1
    k = np.arange(steps + 1, dtype=np.float64)
    two_h = 2.0 * hurst
    autocov = 0.5 * (np.abs(k + 1) ** two_h - 2.0 * k**two_h + np.abs(k - 1) ** two_h)
    # First row of the 2m-circulant matrix embedding the Toeplitz covariance of m increments.
    row = np.concatenate([autocov, autocov[-2:0:-1]])
    eigenvalues = np.fft.fft(row).real
    # fGn's embedding is non-negative definite for every H; clip only round-off.
    eigenvalues = np.clip(eigenvalues, 0.0, None)
    size = row.shape[0]
    noise = rng.standard_normal(size) + 1j * rng.standard_normal(size)
    increments = np.fft.fft(np.sqrt(eigenvalues / size) * noise).real[:steps]
    # Unit-step fGn scaled to step 1/steps (self-similarity).
    increments *= steps ** (-hurst)
    return np.concatenate([[0.0], np.cumsum(increments)])


def make_dataset(
    name: str,
    *,
    seed: int = 0,
    grid_size: int | None = None,
    hurst: float = DEFAULT_HURST,
    test_fraction: float = 0.2,
) -> Dataset:
    """One of DATASET_NAMES; grid_size overrides the paper's s (per axis) for small runs."""
    rng = np.random.default_rng(seed)
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        # Pixel intensities are 0..16; scale to [0, 1] so distances to prototypes are tame.
        x = np.asarray(digits.data, dtype=np.float64) / 16.0
        labels = np.asarray(digits.target, dtype=np.int64)
        classes = [str(c) for c in range(10)]
        return _split(_classification_rows(name, x, labels, classes), rng, test_fraction)
    if name not in DATASET_NAMES:
        raise DataError(
            f"unknown dataset; choose one of {', '.join(DATASET_NAMES)}", source=name
        )
    dim = int(name[-2])
    s = grid_size if grid_size is not None else _PAPER_GRID_SIZE[dim]
    if s < 2:
        raise DataError(f"grid size must be at least 2, got {s}", source=name)
    if name == "holder1d":
        x = regular_grid(s, 1, 0.0, 1.0)
        y = fbm_path(s, hurst, rng)
    else:
        x = regular_grid(s, dim, -1.0, 1.0)
        y = ackley(x) if name.startswith("ackley") else rastrigin(x)
    return _split(_regression_rows(name, x, y.reshape(-1, 1)), rng, test_fraction)


def load_data_file(
    path: Path,
    *,
    target: str | None = None,
    task: Task | Literal["auto"] = "auto",
    seed: int = 0,
    test_fraction: float = 0.2,
) -> Dataset:
    """A user's .npz (arrays X, or x as `momlp loadtest --eval` writes it, and y) or
    .csv/.parquet (all columns but `target` are inputs), split at random into train and test."""
    rows = read_data_file(path, target=target, task=task)
    return _split(rows, np.random.default_rng(seed), test_fraction)


def read_data_file(
    path: Path, *, target: str | None = None, task: Task | Literal["auto"] = "auto"
) -> Rows:
    """A data file's rows as `load_data_file` reads and checks them, not split: for rows that
    are all held out (a calibration), which need neither a test share nor two classes."""
    source = str(path)
    problem = file_problem(path)
    if problem is not None:
        raise DataError(problem, source=source)
    suffix = path.suffix.lower()
    if suffix == ".npz":
        try:
            # The file opened here, not by np.load: numpy leaves its own handle open when
            # the zip is damaged.
            with open_regular(path) as handle:
                archive = np.load(handle, allow_pickle=False)
                if not isinstance(archive, np.lib.npyio.NpzFile):
                    raise DataError("not an .npz archive (a single .npy array?)", source=source)
                inputs = "X" if "X" in archive.files else "x"
                missing = {inputs, "y"} - set(archive.files)
                if missing:
                    raise DataError(
                        f"the archive lacks {sorted(missing)} (has {archive.files})", source=source
                    )
                x_raw, y_raw = archive[inputs], archive["y"]
        except UNREADABLE_ARRAY_FILE as exc:
            # An empty file (EOFError), a damaged zip, a member numpy cannot parse.
            raise DataError(f"cannot read the archive: {unreadable_reason(exc)}",
                            source=source) from exc
        members = ((inputs, x_raw), ("y", y_raw))
        not_arrays = [name for name, a in members if not isinstance(a, np.ndarray)]
        if not_arrays:
            # numpy hands back a member that is not a .npy file as its raw bytes.
            raise DataError(f"the archive's {not_arrays} are not .npy arrays", source=source)
    elif suffix in (".csv", ".parquet"):
        x_raw, y_raw = _read_table(path, target, source)
    else:
        raise DataError(
            f"unknown data file type {suffix!r}; use .npz, .csv or .parquet", source=source
        )
    if x_raw.ndim != 2:
        raise DataError(f"X must be 2-D [rows, features], got shape {x_raw.shape}", source=source)
    if x_raw.shape[0] == 0:
        raise DataError(f"the file holds no rows (X has shape {x_raw.shape})", source=source)
    if y_raw.ndim not in (1, 2) or y_raw.shape[0] != x_raw.shape[0] or 0 in y_raw.shape:
        raise DataError(
            f"y must have one row per row of X ({x_raw.shape[0]}) and at least one column, got"
            f" shape {y_raw.shape}",
            source=source,
        )
    for name, values in (("X", x_raw), ("y", y_raw)):
        if values.dtype.kind in _NOT_REAL:
            # numpy would cast them (a complex number's imaginary part dropped with a warning,
            # a date as a day count) and the store would learn from something else.
            raise DataError(f"{name} is of dtype {values.dtype}, not real numbers",
                            source=source)
    try:
        x = np.asarray(x_raw, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"X is not numeric: {exc}", source=source) from exc
    auto = task == "auto"
    if task == "auto":
        task = "classification" if y_raw.dtype.kind in "iubUSO" else "regression"
    if task == "classification":
        if y_raw.ndim != 1:
            raise DataError("classification targets must be 1-D labels", source=source)
        if y_raw.dtype.kind == "f":
            _check_float_labels(y_raw.astype(np.float64, copy=False), source)
        classes, labels = np.unique(y_raw, return_inverse=True)
        if auto and y_raw.dtype.kind in "iu" and len(classes) > _MANY_CLASSES:
            logger.warning(
                "%s: its integer target reads as %d classes (--task auto); if it is a quantity,"
                " pass --task regression",
                source, len(classes),
            )
        return _classification_rows(
            source, x, labels.astype(np.int64), [str(c) for c in classes]
        )
    try:
        y = np.asarray(y_raw, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"regression targets are not numeric: {exc}", source=source) from exc
    return _regression_rows(source, x, y.reshape(len(y), -1))


def _check_float_labels(y: npt.NDArray[np.floating[Any]], source: str) -> None:
    # Labels written as floats (1.0) are classes; 0.37 is a quantity, and np.unique would make
    # a class of every distinct value.
    if not np.all(np.isfinite(y)):
        raise DataError("y holds NaN or infinite labels", source=source)
    fractional = np.flatnonzero(y != np.round(y))
    if fractional.size:
        raise DataError(
            f"classification labels are integers or names; y holds {fractional.size} "
            f"fractional values (first: {float(y[fractional[0]]):.6g} in row {fractional[0]}); "
            "for a quantity, use the regression task", source=source,
        )


def _read_table(
    path: Path, target: str | None, source: str
) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
    try:
        import pandas as pd
    except ImportError:
        raise DataError(
            "reading a .csv or .parquet table needs pandas (and pyarrow for parquet), which "
            "momlp installs only with its tables extra: pip install 'momlp[tables]'",
            source=source,
        ) from None
    if target is None:
        raise DataError("a table needs --target COLUMN naming the target column", source=source)
    try:
        if path.suffix.lower() == ".csv":
            # A wide file of few rows read in pieces took 2.5 times as long.
            pieces = not _fewer_lines_than(path, _FEW_ROWS)
            with warnings.catch_warnings():
                # A column typed apart piece by piece is dealt with below (a target read again
                # as text, an input refused by name); pandas' advice to pass dtype= or
                # low_memory=False is no option a momlp user has.
                warnings.simplefilter("ignore", pd.errors.DtypeWarning)
                frame = pd.read_csv(path, low_memory=pieces)
        else:
            frame = pd.read_parquet(path)
    except (ValueError, OSError, ImportError) as exc:
        raise DataError(f"cannot read the table: {exc}", source=source) from exc
    if len(frame) == 0:
        # Checked first: a header-only CSV reads as text columns, which the checks below
        # would misreport as non-numeric inputs.
        raise DataError(f"the table holds no rows, only columns {_some(list(frame.columns))}",
                        source=source)
    if not frame.index.equals(pd.RangeIndex(len(frame))):
        # pandas takes a CSV's first field as the rows' names when each row has one field
        # more than the header: that column would silently leave the inputs.
        raise DataError("its rows have more fields than its header names", source=source)
    labels = [str(c) for c in frame.columns]
    unnamed = [label for label in labels if label.startswith("Unnamed: ")]
    if unnamed:
        raise DataError(
            f"columns without a name in the header {_some(unnamed)} (row numbers written by"
            " pandas' to_csv? write it with index=False)", source=source,
        )
    if target not in frame.columns:
        raise DataError(
            f"no column {target!r}; columns are {_some(labels)}", source=source
        )
    # Unique: pandas renames a CSV's repeated names (a, a.1) and refuses a parquet file's.
    position = int(frame.columns.get_loc(target))
    # Per distinct dtype, not per column: a Series per column costs seconds at 300,000 columns.
    dtypes = frame.dtypes
    numeric_dtype = {dtype: pd.api.types.is_numeric_dtype(dtype) for dtype in set(dtypes)}
    non_numeric = [
        label for at, (label, dtype) in enumerate(zip(labels, dtypes, strict=True))
        if at != position and not numeric_dtype[dtype]
    ]
    if non_numeric:
        raise DataError(f"non-numeric input columns {_some(non_numeric)}", source=source)
    if len(labels) == 1:
        raise DataError("the table has no input columns besides the target", source=source)
    column = frame[target]
    mixed = column.dtype == object and not pd.api.types.is_string_dtype(column)
    if mixed and path.suffix.lower() == ".csv":
        column = _csv_column_as_text(path, position, len(frame))
    empty = np.flatnonzero(column.isna().to_numpy())
    if empty.size:
        raise DataError(
            f"the target column {target!r} has {empty.size} empty cells (first: row {empty[0]})",
            source=source,
        )
    numeric = pd.api.types.is_numeric_dtype(column)
    named = pd.api.types.is_string_dtype(column) or isinstance(column.dtype, pd.CategoricalDtype)
    if not numeric and not named:
        # Lists, timestamps, bytes: str() of each would make a class of every value.
        raise DataError(
            f"the target column {target!r} holds {column.dtype} values, neither numbers nor "
            "class names", source=source,
        )
    y = column.to_numpy() if numeric else column.astype(str).to_numpy()
    # The target's cells swapped for numbers (`column` keeps its own) so that one to_numpy
    # reads every input: dropping the column rebuilds the frame column by column, seconds at
    # 300,000 columns.
    frame.isetitem(position, np.zeros(len(frame)))
    x = np.delete(frame.to_numpy(dtype=np.float64), position, axis=1)
    return x, y


# Column names an error lists at most: a wide table's whole header is megabytes of message.
_SHOWN_NAMES = 20


def _some(names: list[Any]) -> str:
    """`names` as a list, cut to the first `_SHOWN_NAMES` with how many more there are."""
    if len(names) <= _SHOWN_NAMES:
        return str(names)
    return f"{names[:_SHOWN_NAMES]} and {len(names) - _SHOWN_NAMES} more"


def _csv_column_as_text(path: Path, position: int, rows: int) -> Any:
    """The CSV's column at `position` as the text of its cells (NaN where empty).

    pandas types a long file piece by piece: a column of numbers and names comes back as
    numbers from some pieces and as text from others (1 beside '1', and 01 read as 1), where
    a whole-file parse keeps the text of every cell. Read alone as text, the column is what
    a short file gives, whatever the file's length.
    """
    import pandas as pd

    source = str(path)
    try:
        column = pd.read_csv(path, usecols=[position], dtype=str).iloc[:, 0]
    except (ValueError, OSError) as exc:
        raise DataError(f"cannot read the table: {exc}", source=source) from exc
    if len(column) != rows:
        raise DataError(f"the file changed while it was read ({rows} rows, then "
                        f"{len(column)})", source=source)
    return column


def _fewer_lines_than(path: Path, limit: int) -> bool:
    """Whether `path` holds fewer than `limit` line breaks; reads no further than the limit."""
    lines = 0
    with open_regular(path) as handle:
        while block := handle.read(1 << 20):
            # pandas ends a line at LF, CRLF or a lone CR (classic Mac): a file of lone CRs
            # counted none, and was parsed whole however long. A CRLF counts once.
            lines += max(block.count(b"\n"), block.count(b"\r"))
            if lines >= limit:
                return False
    return True


def _split_indices(
    rows: int, rng: np.random.Generator, test_fraction: float, source: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test fraction must lie in (0, 1), got {test_fraction}", source=source)
    num_test = int(round(rows * test_fraction))
    if rows < 2 or num_test < 1 or num_test >= rows:
        raise DataError(f"{rows} rows are too few to split into train and test", source=source)
    order = rng.permutation(rows)
    return order[num_test:], order[:num_test]


def _not_float32(values: FloatArray) -> npt.NDArray[np.bool_]:
    """Where `values` are NaN, infinite, or beyond float32's range (training casts to it)."""
    with np.errstate(invalid="ignore"):
        return ~(np.abs(values) <= FLOAT32_MAX)


def _check_inputs(x: FloatArray, source: str) -> None:
    if x.ndim != 2 or x.shape[1] == 0:
        raise DataError(f"inputs must be 2-D [rows, features], got {x.shape}", source=source)
    bad = _not_float32(x)
    if bad.any():
        rows = np.flatnonzero(bad.any(axis=1))
        raise DataError(
            f"inputs hold NaN or infinite values, or values beyond float32 (|v| > 3.4e38), in"
            f" {rows.size} rows (first: row {rows[0]})",
            source=source,
        )


def _regression_rows(source: str, x: FloatArray, y: FloatArray) -> Rows:
    _check_inputs(x, source)
    bad = _not_float32(y)
    if bad.any():
        rows = np.flatnonzero(bad.any(axis=1))
        raise DataError(
            f"targets hold NaN or infinite values, or values beyond float32 (|v| > 3.4e38), in"
            f" {rows.size} rows (first: row {rows[0]})",
            source=source,
        )
    return Rows(source=source, task="regression", x=x, y=y)


def _classification_rows(
    source: str, x: FloatArray, labels: npt.NDArray[np.int64], classes: list[str]
) -> Rows:
    _check_inputs(x, source)
    return Rows(source=source, task="classification", x=x, y=labels, classes=classes)


def _split(rows: Rows, rng: np.random.Generator, test_fraction: float) -> Dataset:
    if rows.task == "classification" and len(rows.classes) < 2:
        raise DataError(
            f"classification needs at least 2 classes, got {rows.classes}", source=rows.source
        )
    train, test = _split_indices(len(rows.x), rng, test_fraction, rows.source)
    y: npt.NDArray[np.float32] | npt.NDArray[np.int64] = (
        rows.y.astype(np.int64) if rows.task == "classification" else rows.y.astype(np.float32)
    )
    return Dataset(
        name=rows.source,
        task=rows.task,
        x_train=rows.x[train].astype(np.float32),
        y_train=y[train],
        x_test=rows.x[test].astype(np.float32),
        y_test=y[test],
        num_classes=len(rows.classes),
        classes=rows.classes,
    )
