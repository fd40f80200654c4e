"""The Open Inference Protocol v2 request and response bodies, JSON and binary.

The binary tensor data extension: a body whose JSON header is `Inference-Header-Content-Length`
bytes long, followed by the raw little-endian bytes of each input whose parameters carry
`binary_data_size`, in input order. Outputs asked for in binary (per output
`parameters.binary_data`, or `parameters.binary_data_output` on the request, which
tritonclient sends when it names no outputs) come back the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server._exceptions import HttpError
from server.http._body import check_rows, refuse_rows_beyond_scan, validation_detail

__all__ = [
    "DTYPES",
    "InferRequest",
    "OutputTensor",
    "ParsedInfer",
    "encode_response",
    "parse_infer",
    "wanted_outputs",
]

HEADER_LENGTH = "inference-header-content-length"
DTYPES: dict[str, np.dtype[Any]] = {
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "INT64": np.dtype("<i8"),
}
_INPUT_DTYPES = ("FP32", "FP64")


class _Lenient(BaseModel):
    # Clients add fields of their own (KServe: id, model_name; MLServer: content_type):
    # ignored, never refused.
    model_config = ConfigDict(extra="ignore")


class RequestInput(_Lenient):
    name: str
    shape: list[int] = Field(min_length=1, max_length=8)
    datatype: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: list[Any] | None = None


class RequestOutput(_Lenient):
    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferRequest(_Lenient):
    """`POST /v2/models/{name}/infer`: one input tensor `input` [B, n], FP32 or FP64."""

    id: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[RequestInput] = Field(min_length=1, max_length=1)
    outputs: list[RequestOutput] | None = None


@dataclass(frozen=True)
class ParsedInfer:
    request: InferRequest
    x: np.ndarray[Any, np.dtype[np.float32]]


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str
    data: np.ndarray[Any, Any]


def _bad(message: str, detail: Any = None) -> HttpError:
    return HttpError(422, "invalid_input", message, detail=detail)


def parse_infer(
    body: bytes,
    header_length: str | None,
    *,
    input_name: str,
    input_dim: int,
    max_rows: int,
) -> ParsedInfer:
    """The request and its input rows as float32 [B, input_dim], checked once."""
    if header_length is None:
        json_part, binary = body, b""
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise _bad("Inference-Header-Content-Length is not an integer") from None
        if not 0 < length <= len(body):
            raise _bad(f"Inference-Header-Content-Length {length} does not fit the body")
        json_part, binary = body[:length], body[length:]
    # The data's values are separated by commas: beyond max_rows rows of input_dim values
    # (and the few commas of the rest of the request) the shape's check would refuse it only
    # after a parse that holds the server's GIL.
    refuse_rows_beyond_scan(json_part, b",", max_rows * input_dim + 1024, "commas")
    try:
        request = InferRequest.model_validate_json(json_part)
    except ValidationError as exc:
        detail = validation_detail(exc)
        raise _bad("the inference request does not match the protocol", detail) from exc
    tensor = request.inputs[0]
    if tensor.name != input_name:
        raise _bad(f"unknown input {tensor.name!r}; this model's input is {input_name!r}")
    if tensor.datatype not in _INPUT_DTYPES:
        raise _bad(f"input datatype {tensor.datatype} is not one of {', '.join(_INPUT_DTYPES)}")
    if len(tensor.shape) != 2:
        raise _bad(f"input shape {tensor.shape} is not [batch, {input_dim}]")
    rows, cols = tensor.shape
    check_rows(rows, cols, max_rows=max_rows, input_dim=input_dim)
    dtype = DTYPES[tensor.datatype]
    _refuse_unsupported(tensor.parameters, f"input {tensor.name!r}")
    size = tensor.parameters.get("binary_data_size")
    if size is not None and tensor.data is not None:
        raise _bad("the input has both data and binary_data_size: send one of them")
    if size is None and binary:
        # Bytes after the JSON header that no input claims: a client's framing is off (a
        # binary flag lost on the way), and the JSON data would be served in their place.
        raise _bad(
            f"{len(binary)} bytes of binary data follow the JSON header, but the input has no "
            "binary_data_size"
        )
    if size is not None:
        expected = rows * cols * dtype.itemsize
        if isinstance(size, bool) or not isinstance(size, int):
            raise _bad(f"binary_data_size must be an integer, got {size!r}")
        if size != expected or len(binary) != expected:
            raise _bad(
                f"binary input of {len(binary)} bytes (binary_data_size {size}), its shape "
                f"needs {expected}"
            )
        array = np.frombuffer(binary, dtype=dtype).reshape(rows, cols)
    else:
        if tensor.data is None:
            raise _bad("the input has neither data nor binary_data_size")
        try:
            # Row-major flat data, or nested rows; either way the shape decides. No dtype
            # asked for, so that strings, booleans and ints beyond int64 are seen, not cast.
            flat = np.asarray(tensor.data).reshape(-1)
        except (TypeError, ValueError):
            raise _bad("input data must be numbers") from None
        # A boolean among numbers is cast to 1 or 0 without a trace: look for one, but only
        # when the request's JSON has a true or false anywhere (a scan of its bytes).
        if flat.dtype.kind not in "iuf" or (
            (b"true" in json_part or b"false" in json_part) and _holds_bool(tensor.data)
        ):
            raise _bad("input data must be JSON numbers (no strings, booleans or huge integers)")
        if flat.size != rows * cols:
            raise _bad(f"input holds {flat.size} values, its shape needs {rows * cols}")
        array = flat.reshape(rows, cols)
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.array(array, dtype=np.float32, order="C", copy=True)
    if not bool(np.isfinite(x).all()):
        bad = np.argwhere(~np.isfinite(x))[0]
        raise _bad(
            "inputs must be finite float32 numbers (no NaN, no Inf, |x| < 3.4e38)",
            {"row": int(bad[0]), "column": int(bad[1])},
        )
    return ParsedInfer(request, x)


def _holds_bool(data: Any) -> bool:
    """Whether nested lists `data` hold a bool anywhere."""
    pending = [data]
    while pending:
        item = pending.pop()
        if not isinstance(item, list):
            continue
        kinds = set(map(type, item))
        if bool in kinds:
            return True
        if list in kinds:
            pending.extend(item)
    return False


def wanted_outputs(request: InferRequest, names: list[str]) -> dict[str, bool]:
    """The outputs to answer with, in order, each with whether it goes in binary; 422 for an
    output the model does not have or a flag that is not a boolean (checked before any work)."""
    binary_all = _flag(request.parameters, "binary_data_output", False)
    if not request.outputs:
        # None or [] alike: "all outputs" when none are named, as Triton answers an empty list.
        return {name: binary_all for name in names}
    unknown = [out.name for out in request.outputs if out.name not in names]
    if unknown:
        raise _bad(f"unknown output(s) {unknown}; this model has {sorted(names)}")
    wanted: dict[str, bool] = {}
    for out in request.outputs:
        if out.name in wanted:
            # Its two entries may disagree (binary or not): neither would be answered as asked.
            raise _bad(f"output {out.name!r} is requested more than once")
        _refuse_unsupported(out.parameters, f"output {out.name!r}")
        wanted[out.name] = _flag(out.parameters, "binary_data", binary_all)
    return wanted


# Parameters of extensions this server does not implement (its metadata lists only
# binary_tensor_data): answered as if absent, the client would read what it did not ask for
# (raw scores as class labels, a shared-memory region nobody wrote).
_UNSUPPORTED = {
    "classification": (
        "the classification extension (class_count)", "ask for the output without it"
    ),
    "shared_memory_region": ("shared memory", "send and take tensors in the body"),
}


def _refuse_unsupported(parameters: dict[str, Any], what: str) -> None:
    for name, (extension, instead) in _UNSUPPORTED.items():
        if name in parameters:
            raise _bad(f"{what} asks for {extension}, which this server does not support: "
                       f"{instead}")


def _flag(parameters: dict[str, Any], name: str, default: bool) -> bool:
    # bool("false") is True: a flag must be a JSON boolean (or "true"/"false", as some clients
    # write them).
    value = parameters.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise _bad(f"parameter {name} must be true or false, got {value!r}")


def encode_response(
    request: InferRequest,
    outputs: list[OutputTensor],
    *,
    model_name: str,
    model_version: str,
    parameters: dict[str, Any],
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows it."""
    wanted = wanted_outputs(request, [tensor.name for tensor in outputs])
    by_name = {tensor.name: tensor for tensor in outputs}
    described: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, binary in wanted.items():
        tensor = by_name[name]
        entry: dict[str, Any] = {
            "name": name,
            "datatype": tensor.datatype,
            "shape": list(tensor.data.shape),
        }
        if binary:
            raw = np.ascontiguousarray(tensor.data, dtype=DTYPES[tensor.datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = tensor.data.reshape(-1).tolist()
        described.append(entry)
    header: dict[str, Any] = {
        "model_name": model_name,
        "model_version": model_version,
        "outputs": described,
        "parameters": parameters,
    }
    if request.id is not None:
        header["id"] = request.id
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if not chunks:
        return head, None
    return head + b"".join(chunks), len(head)
