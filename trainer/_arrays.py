"""What every kind's data reader checks of a user's arrays, in one place: which errors mean an
.npz or .npy file cannot be read, and whether an array holds numbers training can use.

    problem = number_problem("y", y)   # None, or "y holds NaN or infinite values in ..."
"""

from __future__ import annotations

import os
import stat
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

__all__ = ["FLOAT32_MAX", "MAX_CLASSES", "UNREADABLE_ARRAY_FILE", "class_count_problem",
           "number_problem", "open_regular", "unreadable_reason"]

FLOAT32_MAX = float(np.finfo(np.float32).max)
# What np.load and the zip reader raise on a file that is not a readable .npz or .npy: an
# empty file (EOFError), a truncated or foreign one (BadZipFile, zlib.error), a compression
# method the zip module lacks (NotImplementedError), a member numpy cannot parse (ValueError),
# a header that claims more memory than there is (MemoryError: a 1 KB file can claim TiBs).
UNREADABLE_ARRAY_FILE = (
    OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error, NotImplementedError,
    MemoryError,
)
# Class labels are the output layer's unit indices (0..C-1): a stray 10**9 would otherwise ask
# for a layer of 10**9 units and end the build in an out-of-memory kill, not in an error.
MAX_CLASSES = 65_536
# bool, signed and unsigned integers, floats: what casts to float32 without losing its meaning.
_NUMBER_KINDS = "biuf"


def number_problem(name: str, values: npt.NDArray[np.generic]) -> str | None:
    """Why `values` are not real numbers that stay finite as float32 (what training sees),
    naming `name` and the first bad row; None when they are."""
    if values.dtype.kind not in _NUMBER_KINDS:
        return f"{name} must be numbers (bool, int or float), got dtype {values.dtype}"
    if values.dtype.kind != "f":
        return None  # the widest integers (about 1.8e19) are far inside float32's range
    bad = ~np.isfinite(values)
    if bad.any():
        count, first = _bad_rows(bad)
        return f"{name} holds NaN or infinite values in {count} rows (first: row {first})"
    bad = np.abs(values) > FLOAT32_MAX
    if bad.any():
        count, first = _bad_rows(bad)
        return (f"{name} holds values beyond float32's range (|v| > {FLOAT32_MAX:.3g}) in"
                f" {count} rows (first: row {first})")
    return None


def class_count_problem(name: str, labels: npt.NDArray[np.generic]) -> str | None:
    """Why integer `labels` (one per row, all >= 0) cannot index an output layer of at most
    MAX_CLASSES units; None when they can."""
    top = int(labels.max()) if labels.size else 0
    if top < MAX_CLASSES:
        return None
    return (f"{name}'s class labels index the output layer (0..C-1), and its largest, {top} "
            f"(row {int(np.argmax(labels))}), asks for {top + 1} units; at most {MAX_CLASSES}: "
            "number the classes 0..C-1")


def _bad_rows(bad: npt.NDArray[np.bool_]) -> tuple[int, int]:
    rows = np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))
    return int(rows.size), int(rows[0])


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading; an OSError (which every reader reports as unreadable) if it
    is not a regular file: a FIFO would block the read for good, /dev/zero never end it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def unreadable_reason(exc: BaseException) -> str:
    """Why an .npz or .npy file could not be read, from what np.load raised. numpy answers
    any bytes it cannot parse (a CSV, random bytes) as if they were a pickle, with advice to
    allow unpickling: momlp never does, and the file need not be one."""
    text = str(exc) or type(exc).__name__
    if "allow_pickle" in text:
        return "neither an .npz archive nor an .npy array of numbers (momlp never unpickles)"
    return text
