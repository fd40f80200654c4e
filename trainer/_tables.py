"""A user's .csv or .parquet table as arrays: every column but the target is an input, and
each is checked (named, numeric, no empty target cell) before a number is taken from it.
Needs pandas (momlp's tables extra), imported only when a table is read."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ._arrays import open_regular
from ._exceptions import DataError

__all__ = ["read_table"]

# A CSV of fewer rows than this is parsed whole (low_memory=False). pandas' default parses it in
# pieces and pays a per-column cost for each: past 10 MB two parallel halves and a sample row,
# and below that, on a wide file, pieces of 2**20 / width rows (2 rows at 300,000 columns), each
# typed alone. A longer file keeps the default: its parallel read is the faster one.
_FEW_ROWS = 4000


def read_table(
    path: Path, target: str | None, source: str
) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
    """The table at `path` as its inputs (float64 [N, n]) and its `target` column's values
    [N]; DataError naming `source` when it cannot be read or a column is unfit."""
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
