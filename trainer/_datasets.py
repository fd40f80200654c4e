"""The datasets a store is built from: the paper's and sklearn's by name (`make_dataset`,
`trainer._paper_data`) and a user's data files (.npz, .csv, .parquet), read here.

Every dataset comes back as a `Dataset` already split 80/20 at random (seeded) and
validated: finite numbers, 2-D inputs, one target row per input row (`trainer._rows`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from experts_store import file_problem

from ._arrays import UNREADABLE_ARRAY_FILE, open_regular, unreadable_reason
from ._exceptions import DataError
from ._paper_data import DATASET_NAMES, ackley, fbm_path, make_dataset, rastrigin, regular_grid
from ._paper_data import DEFAULT_HURST as DEFAULT_HURST  # trainer._config's default
from ._rows import Dataset, Rows, Task, classification_rows, regression_rows, split
from ._tables import read_table

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

logger = logging.getLogger(__name__)

# Complex, datetime, timedelta and structured dtypes: numbers only by a cast that loses what
# they mean.
_NOT_REAL = "cmMV"


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
    return split(rows, np.random.default_rng(seed), test_fraction)


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
        x_raw, y_raw = read_table(path, target, source)
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
        return classification_rows(
            source, x, labels.astype(np.int64), [str(c) for c in classes]
        )
    try:
        y = np.asarray(y_raw, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"regression targets are not numeric: {exc}", source=source) from exc
    return regression_rows(source, x, y.reshape(len(y), -1))


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

