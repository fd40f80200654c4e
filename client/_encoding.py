"""Turn whatever the caller holds (lists, tuples, numpy arrays, tensors) into a request body.

numpy is optional: with it, big arrays travel as `application/x-npy`; without it everything is
validated in pure Python and sent as JSON (or as .npy written with the stdlib when asked).
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._exceptions import InputError

__all__ = ["EncodedInputs", "encode_inputs", "npy_bytes", "numpy_or_none", "rows_from_sequences"]

NPY_CONTENT_TYPE = "application/x-npy"


def numpy_or_none() -> Any:
    """The numpy module, or None where it is not installed (or blocked)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


@dataclass(frozen=True)
class EncodedInputs:
    """Exactly one of `rows` (for a JSON body) and `npy` (for an x-npy body) is set."""

    num_rows: int
    dim: int
    rows: list[list[float]] | None = None
    npy: bytes | None = None


def encode_inputs(
    inputs: Any, *, binary: bool | None = None, binary_min_values: int = 16384
) -> EncodedInputs:
    """Validate `inputs` as a 2-D finite numeric batch [rows, dim] and encode it.

    `binary=None` picks .npy for numpy-like inputs holding at least `binary_min_values` numbers
    (JSON costs ~20 bytes and a float parse per number there); True forces .npy; False forces JSON.
    """
    np = numpy_or_none()
    if np is not None and (isinstance(inputs, np.ndarray) or hasattr(inputs, "__array__")):
        return _encode_numpy(np, inputs, binary=binary, binary_min_values=binary_min_values)
    if np is not None and binary:
        return _encode_numpy(np, inputs, binary=True, binary_min_values=binary_min_values)
    if hasattr(inputs, "tolist") and not isinstance(inputs, list | tuple):
        inputs = inputs.tolist()
    rows = rows_from_sequences(inputs)
    dim = len(rows[0])
    if binary:
        # Python floats are float64: keep them exact, as numpy would for the same lists.
        flat = array("d", (value for row in rows for value in row))
        if sys.byteorder != "little":
            flat.byteswap()
        return EncodedInputs(len(rows), dim, npy=npy_bytes(flat.tobytes(), "<f8", (len(rows), dim)))
    return EncodedInputs(len(rows), dim, rows=rows)


def _encode_numpy(
    np: Any, inputs: Any, *, binary: bool | None, binary_min_values: int
) -> EncodedInputs:
    if callable(getattr(inputs, "detach", None)):
        # A torch tensor that requires grad refuses np.asarray; its values are what is sent.
        inputs = inputs.detach().cpu()
    try:
        arr = np.asarray(inputs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"inputs are not an array: {exc}") from exc
    if arr.dtype.kind not in "fiu":
        raise InputError(f"inputs must be numbers, got dtype {arr.dtype}", dtype=str(arr.dtype))
    _check_shape(tuple(arr.shape))
    if not bool(np.isfinite(arr).all()):
        raise InputError("inputs hold NaN or infinity")
    use_binary = binary if binary is not None else arr.size >= binary_min_values
    rows, dim = int(arr.shape[0]), int(arr.shape[1])
    if not use_binary:
        return EncodedInputs(rows, dim, rows=arr.astype(np.float64).tolist())
    descr = "<f8" if arr.dtype == np.float64 else "<f4"
    data = np.ascontiguousarray(arr, dtype=np.dtype(descr)).tobytes()
    return EncodedInputs(rows, dim, npy=npy_bytes(data, descr, (rows, dim)))


def _check_shape(shape: tuple[int, ...], what: str = "inputs") -> None:
    if len(shape) != 2:
        raise InputError(
            f"{what} must be 2-D [rows, dim], got shape {shape}; wrap one input as [x]",
            shape=shape,
        )
    if shape[0] == 0 or shape[1] == 0:
        raise InputError(f"{what} are empty (shape {shape})", shape=shape)


def rows_from_sequences(inputs: Any, *, what: str = "inputs") -> list[list[float]]:
    """`inputs` as rows of finite floats, all of one width; `what` names them in errors."""
    if not isinstance(inputs, Sequence) or isinstance(inputs, str | bytes):
        raise InputError(f"{what} must be a 2-D sequence of numbers, got {type(inputs).__name__}")
    rows: list[list[float]] = []
    dim: int | None = None
    for index, row in enumerate(inputs):
        if hasattr(row, "tolist") and not isinstance(row, list | tuple):
            row = row.tolist()
        if not isinstance(row, Sequence) or isinstance(row, str | bytes):
            raise InputError(f"{what} must be 2-D [rows, dim]; wrap one input as [x]", row=index)
        values = [_number(value, index, what) for value in row]
        if dim is None:
            dim = len(values)
        elif len(values) != dim:
            raise InputError(f"{what}: row {index} has {len(values)} values, row 0 has {dim}",
                             row=index)
        rows.append(values)
    _check_shape((len(rows), dim or 0), what)
    return rows


def _number(value: Any, row: int, what: str) -> float:
    # numpy scalars and similar expose __float__; strings, bools and None do not get through.
    if isinstance(value, str | bytes | bool) or not hasattr(value, "__float__"):
        raise InputError(f"{what}: row {row} holds a non-number {value!r}", row=row)
    try:
        number = float(value)
    except OverflowError:  # an int of hundreds of digits
        raise InputError(f"{what}: row {row} holds a number beyond float range", row=row) from None
    if not math.isfinite(number):
        raise InputError(f"{what}: row {row} holds {number}; they must be finite", row=row)
    return number


def npy_bytes(data: bytes, descr: str, shape: tuple[int, int]) -> bytes:
    """An .npy (format 1.0) file around raw little-endian C-order `data`."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({shape[0]}, {shape[1]}), }}"
    # magic(6) + version(2) + length(2) + header + "\n" is padded to a multiple of 64 bytes.
    unpadded = 10 + len(header) + 1
    header += " " * (-unpadded % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + data
