"""The table every dataset ends in: a source's rows checked (finite numbers within float32,
2-D inputs, one target row per input row) as `Rows`, and split 80/20 at random (seeded)
into the `Dataset` training uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from ._arrays import FLOAT32_MAX
from ._exceptions import DataError

__all__ = [
    "Dataset",
    "FloatArray",
    "Rows",
    "Task",
    "classification_rows",
    "regression_rows",
    "split",
]

Task = Literal["regression", "classification"]
FloatArray = npt.NDArray[np.float64]


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


def regression_rows(source: str, x: FloatArray, y: FloatArray) -> Rows:
    """Checked regression rows: inputs [N, n] and targets [N, out], each within float32."""
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


def classification_rows(
    source: str, x: FloatArray, labels: npt.NDArray[np.int64], classes: list[str]
) -> Rows:
    """Checked classification rows: inputs [N, n] within float32, labels indexing `classes`."""
    _check_inputs(x, source)
    return Rows(source=source, task="classification", x=x, y=labels, classes=classes)


def split(rows: Rows, rng: np.random.Generator, test_fraction: float) -> Dataset:
    """`rows` split at random into train and test (`test_fraction` of them), as float32."""
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
