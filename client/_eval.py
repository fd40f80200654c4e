"""`momlp loadtest --eval FILE.npz`: rows with targets, and the accuracy of the answers.

The load test sends the file's rows in order, in passes: each pass is ⌈N/batch⌉ requests
of `batch` rows, the last one shorter, so that each pass sends every row once and no row
weighs more than another in the score. It scores every answered row: squared error per
output value for a regression model, argmax == label for a classifier (the task comes from
/v1/model). Unless told how many requests to send or for how long, it sends one pass
(`EvalSet.requests_per_pass`). The inputs are array `x`, or `X` as `momlp build --data` reads them.
numpy is needed (imported only here, only when --eval is given).
"""

from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._encoding import numpy_or_none
from ._exceptions import InputError

__all__ = ["EvalSet", "load_eval_set"]


@dataclass(frozen=True)
class EvalSet:
    """The rows (`x` [N, input_dim]) and targets of --eval, and how to score answers."""

    path: str
    task: str  # "regression" | "classification"
    x: Any  # numpy float64 [N, input_dim]
    y: Any  # regression: float64 [N, output_dim]; classification: int64 [N]

    @property
    def metric(self) -> str:
        return "accuracy" if self.task == "classification" else "mse"

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def requests_per_pass(self, batch: int) -> int:
        """Requests of `batch` rows (the last one shorter) that send every row once."""
        return -(-len(self) // batch)

    def positions(self, index: int, batch: int) -> list[int]:
        """The file rows request `index` carries: batch rows, fewer at the end of a pass."""
        start = (index % self.requests_per_pass(batch)) * batch
        return list(range(start, min(start + batch, len(self))))

    def rows(self, positions: list[int]) -> list[list[float]]:
        return [[float(v) for v in self.x[p]] for p in positions]

    def score(self, positions: list[int], outputs: list[list[float]]) -> tuple[float, int]:
        """(sum of squared errors, values compared) or (correct rows, rows) of one answer."""
        np = numpy_or_none()
        assert np is not None  # load_eval_set checked it
        got = np.asarray(outputs, dtype=np.float64)
        if self.task == "classification":
            labels = self.y[positions]
            return float((got.argmax(axis=1) == labels).sum()), len(positions)
        target = self.y[positions]
        return float(((got - target) ** 2).sum()), int(target.size)


def _read(path: Path) -> tuple[Any, Any]:
    np = numpy_or_none()
    if np is None:
        raise InputError("--eval needs numpy (pip install numpy)")
    if not path.is_file():  # a FIFO would block the read for good
        raise InputError(f"{path}: {'not a regular file' if path.exists() else 'no such file'}")
    try:
        # The file opened here, not by np.load: numpy leaves its own handle open when the
        # zip is damaged.
        with path.open("rb") as handle:
            loaded = np.load(handle, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise InputError(f"{path}: one array (np.save), not an .npz archive (np.savez)")
            with loaded as data:
                name = "x" if "x" in data.files else "X"
                x, y = data[name], data["y"]
    except InputError:
        raise
    except KeyError as exc:
        raise InputError(f"{path}: an --eval file needs arrays 'x' (or 'X') and 'y'") from exc
    except (OSError, ValueError, EOFError, MemoryError, zipfile.BadZipFile, zlib.error,
            NotImplementedError) as exc:
        # A damaged or empty file, a member numpy cannot parse, a header claiming TiBs.
        raise InputError(f"{path}: cannot read an .npz: {str(exc) or type(exc).__name__}") from exc
    for label, values in (("x", x), ("y", y)):
        if not isinstance(values, np.ndarray) or values.dtype.kind not in "biuf":
            kind = values.dtype if isinstance(values, np.ndarray) else "not an .npy array"
            raise InputError(f"{path}: {label} must hold real numbers ({kind})")
    return np.asarray(x, dtype=np.float64), y


def load_eval_set(path: Path, *, task: str, input_dim: int, output_dim: int) -> EvalSet:
    """Read `x` and `y` from an .npz (no pickles) and check them against the served model."""
    x, y = _read(path)
    np = numpy_or_none()
    assert np is not None  # _read checked it
    if x.ndim != 2 or x.shape[1] != input_dim or len(x) == 0:
        raise InputError(
            f"{path}: x must be [rows, {input_dim}] (the model's input_dim), got {list(x.shape)}"
        )
    if len(y) != len(x):
        raise InputError(f"{path}: y has {len(y)} rows, x has {len(x)}")
    if task == "classification":
        if y.ndim > 2 or not np.isfinite(y).all():
            raise InputError(f"{path}: y must be finite labels [N] or rows [N, C] of scores")
        # Labels [N], or one-hot / probability rows [N, C] read by their argmax.
        labels = y.argmax(axis=1) if y.ndim == 2 and y.shape[1] > 1 else y.reshape(len(y))
        return EvalSet(str(path), task, x, labels.astype(np.int64))
    target = y.astype(np.float64).reshape(len(y), -1)
    if target.shape[1] != output_dim:
        raise InputError(
            f"{path}: y must have {output_dim} value(s) per row (the model's output_dim), "
            f"got {target.shape[1]}"
        )
    return EvalSet(str(path), task, x, target)
