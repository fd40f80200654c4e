"""The bodies of predict and route: JSON, npy and raw float32, parsed into typed rows.

Each form is refused (413/422) from what it declares before its data is touched where it can
be: an npy header, the raw form's `X-Momlp-Rows`, a large JSON body's count of arrays. The
body itself is read, its limits kept and its Content-Encoding decoded by `_body`.
"""

from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError
from starlette.requests import Request

from server._exceptions import HttpError
from server.http._body import (
    JSON_TYPES,
    _body_headers,
    _invalid,
    _too_large,
    check_rows,
    parse_encoded,
    read_body_limited,
    refuse_rows_beyond_scan,
    validation_detail,
)
from server.http._deadline import Deadline
from server.http._models import PredictRequest, RouteRequest
from server.kinds import ConditionRequest, GateRequest, PatchInputs

__all__ = ["ParsedInputs", "parse_inputs", "parse_npy", "parse_raw_float32"]

NPY_TYPE = "application/x-npy"
RAW_TYPE = "application/octet-stream"
_NPY_DTYPES = ("<f4", "<f8", ">f4", ">f8")


def _finite_float32(array: Any) -> np.ndarray[Any, np.dtype[np.float32]]:
    """`array` (an array, or a JSON body's lists of floats) as a new float32 array, refused
    with 422 if any value is NaN, infinite or beyond float32's range."""
    # A copy: the result must be writable (torch refuses read-only buffers) and C-ordered.
    # Values beyond float32's range become inf here, and are refused below.
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.array(array, dtype=np.float32, order="C", copy=True)
    if not bool(np.isfinite(out).all()):
        bad = np.argwhere(~np.isfinite(out))[0]
        raise _invalid(
            "inputs must be finite float32 numbers (no NaN, no Inf, |x| < 3.4e38)",
            {"row": int(bad[0]), "column": int(bad[1])},
        )
    return out


def _check_image(shape: tuple[int, ...], image: PatchInputs | None, *, max_rows: int) -> None:
    expected = image.image_shape if image is not None else None
    if expected is None:
        raise _invalid(f"npy array must be 2-D, got shape {list(shape)}", {"shape": list(shape)})
    if tuple(shape[1:]) != expected:
        raise _invalid(
            f"npy images must be [B, {', '.join(map(str, expected))}] (B, H, W, C), got "
            f"{list(shape)}",
            {"shape": list(shape), "expected": ["B", *expected]},
        )
    check_rows(shape[0], 0, max_rows=max_rows, input_dim=0)


def parse_npy(
    body: bytes, *, max_rows: int, input_dim: int, image: PatchInputs | None = None
) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A 2-D float32/float64 .npy array; the header is checked before any data is touched.

    With `image` (a kind that takes images), a 4-D [B, H, W, C] array of its image shape is
    accepted too and cut into its flat patch rows."""
    stream = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported npy version {version}")
    except (ValueError, SyntaxError, tokenize.TokenError) as exc:
        # numpy re-reads a 1.0 header that does not parse through `tokenize`, which raises
        # its own error for an unclosed bracket.
        raise _invalid(f"not a valid .npy body: {exc}") from exc
    if dtype.str not in _NPY_DTYPES:
        raise _invalid(f"npy dtype {dtype.str} is not float32 or float64", {"dtype": dtype.str})
    if len(shape) == 4 or (image is not None and image.image_shape and len(shape) != 2):
        _check_image(tuple(shape), image, max_rows=max_rows)
    elif len(shape) != 2:
        raise _invalid(f"npy array must be 2-D, got shape {list(shape)}", {"shape": list(shape)})
    else:
        check_rows(shape[0], shape[1], max_rows=max_rows, input_dim=input_dim)
    offset = stream.tell()
    count = int(np.prod(shape))
    expected = count * dtype.itemsize
    if len(body) - offset != expected:
        raise _invalid(f"npy data holds {len(body) - offset} bytes, its header promises {expected}")
    flat = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    array = flat.reshape(shape, order="F" if fortran else "C")
    if len(shape) == 4 and image is not None:
        array = image.image_rows(array)
    return _finite_float32(array)


def _row_count(header: str | None, max_rows: int) -> int:
    """`X-Momlp-Rows` as a number of rows, read before the body.

    ASCII digits, as HTTP writes Content-Length (RFC 9110 8.6), leading zeros and the blanks
    around them allowed: 422 for anything else at every length (a sign, `_`, `.`, `²`, which
    int() took or refused by the number's length: `+` and 5,000 digits was a 422, the same
    digits unsigned a 413); 413 for more digits than `max_rows` has, counted unconverted:
    int() refuses over 4,300 digits.
    """
    if header is None:
        raise _invalid("a raw float32 body needs the X-Momlp-Rows header")
    text = header.strip(" \t")
    if not (text.isascii() and text.isdigit()):
        raise _invalid(
            f"X-Momlp-Rows must be a row count in decimal digits, got {header[:32]!r}",
            {"header": "X-Momlp-Rows"},
        )
    digits = text.lstrip("0")
    if len(digits) > len(str(max_rows)):
        raise _too_large(
            f"X-Momlp-Rows holds a number of {len(digits)} digits, beyond the limit of "
            f"{max_rows} rows",
            {"max_rows": max_rows},
        )
    return int(digits or "0")


def parse_raw_float32(
    body: bytes, rows: int, *, max_rows: int, input_dim: int
) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Raw little-endian float32, row-major, `rows` rows (its `X-Momlp-Rows`) of `input_dim`
    values."""
    check_rows(rows, input_dim, max_rows=max_rows, input_dim=input_dim)
    expected = rows * input_dim * 4
    if len(body) != expected:
        raise _invalid(
            f"body holds {len(body)} bytes, {rows} rows of dimension {input_dim} need {expected}",
            {"bytes": len(body), "expected_bytes": expected},
        )
    return _finite_float32(np.frombuffer(body, dtype="<f4").reshape(rows, input_dim))


@dataclass(frozen=True)
class ParsedInputs:
    x: np.ndarray[Any, np.dtype[np.float32]]
    gate: GateRequest  # top_k, mode and the gate object, None where the request left them
    return_stats: bool
    return_routing: bool = False
    conditions: ConditionRequest | None = None  # kind hyper's conditions (JSON bodies)


def _json_inputs(
    body: bytes, model: type[RouteRequest], *, max_rows: int, input_dim: int
) -> ParsedInputs:
    # A row is one array (two with a hyper request's per-row conditions), and a request holds
    # a few more (the outer one, a beam): more than that bound is over max_rows, known unread.
    # Three brackets in a row are deeper than rows of numbers: a shape error, left to the
    # parse, which stops at its depth limit.
    refuse_rows_beyond_scan(body, b"[", 2 * max_rows + 16, "arrays", nested=b"[[[")
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid(
            "the request body does not match the schema", validation_detail(exc)
        ) from exc
    rows = parsed.inputs
    lengths = {len(row) for row in rows}
    if len(lengths) > 1:
        first_bad = next(i for i, row in enumerate(rows) if len(row) != len(rows[0]))
        raise _invalid(
            "inputs are ragged: every row must have the same length",
            {"row": first_bad, "length": len(rows[first_bad]), "expected": len(rows[0])},
        )
    check_rows(len(rows), len(rows[0]), max_rows=max_rows, input_dim=input_dim)
    # Straight from the lists to float32: a float64 array between them rounds each value the
    # same way, at the cost of a second array.
    x = _finite_float32(rows)
    return_stats = parsed.return_stats if isinstance(parsed, PredictRequest) else False
    return_routing = parsed.return_routing if isinstance(parsed, PredictRequest) else False
    g = parsed.gate
    gate = GateRequest(
        top_k=parsed.top_k,
        mode=parsed.mode,
        temperature=g.temperature if g else None,
        min_weight=g.min_weight if g else None,
        top_p=g.top_p if g else None,
        beam=tuple(g.beam) if g and g.beam is not None else None,
        score=g.score if g else None,
    )
    given = [name for name in ("conditions", "condition", "condition_ids")
             if getattr(parsed, name) is not None]
    if len(given) > 1:
        raise _invalid(f"give one of {', '.join(given)}, not several", {"fields": given})
    conditions = ConditionRequest(
        conditions=parsed.conditions, condition=parsed.condition,
        condition_ids=parsed.condition_ids,
    ) if given else None
    return ParsedInputs(x, gate, return_stats, return_routing, conditions)


async def parse_inputs(
    request: Request,
    *,
    max_bytes: int,
    max_rows: int,
    input_dim: int,
    gate: GateRequest,
    return_stats: bool,
    model: type[RouteRequest] = PredictRequest,
    body_deadline: Deadline | None = None,
    image: PatchInputs | None = None,
    return_routing: bool = False,
) -> ParsedInputs:
    """Read and parse a predict/route body; query parameters (`gate`, `return_stats`) apply
    to the binary forms."""
    headers = _body_headers(request)
    media = headers.media
    if media not in (*JSON_TYPES, NPY_TYPE, RAW_TYPE):
        raise HttpError(
            415,
            "unsupported_media_type",
            f"Content-Type {media!r} is not one of application/json, {NPY_TYPE}, {RAW_TYPE}",
        )
    raw_rows = 0
    if media == RAW_TYPE:
        # The row count is known from the header, so a too-large batch, or a header that is
        # no count, is refused unread.
        raw_rows = _row_count(headers.rows, max_rows)
        check_rows(raw_rows, input_dim, max_rows=max_rows, input_dim=input_dim)
    body = await read_body_limited(request, max_bytes, body_deadline, declared=headers.length)

    def parse(body: bytes) -> ParsedInputs:
        if media in JSON_TYPES:
            return _json_inputs(body, model, max_rows=max_rows, input_dim=input_dim)
        if media == NPY_TYPE:
            x = parse_npy(body, max_rows=max_rows, input_dim=input_dim, image=image)
        else:
            x = parse_raw_float32(body, raw_rows, max_rows=max_rows, input_dim=input_dim)
        return ParsedInputs(x, gate, return_stats, return_routing)

    return await parse_encoded(body, headers.encoding, parse, max_bytes=max_bytes)
