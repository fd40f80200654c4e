"""The frames of an actor channel (`_channel`): one `run` call and its answer, without pickle.

A frame is a fixed prefix (magic, header length, body length), a JSON header, then a body of
raw little-endian arrays laid end to end in the order the header lists them. A request
carries the groups' `ExpertRef`s and row shapes; an answer carries an `ActorReply` with each
outcome's output shape, or a failure reason. Decoding checks every field's type and that the
arrays fill the body exactly, so a corrupt frame is a `WireError`, never a wrong answer.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from experts_store import ExpertRef, GeneratedRef, GeneratorRef
from server.pool._types import ActorReply, GroupOutcome

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_HEADER_BYTES",
    "PREFIX",
    "ChannelError",
    "RunPayload",
    "WireError",
    "decode_reply",
    "decode_run",
    "encode_failure",
    "encode_reply",
    "encode_run",
    "parse_prefix",
]

RunPayload = list[tuple[ExpertRef, np.ndarray]]

PREFIX = struct.Struct("<4sIQ")
_MAGIC = b"MLW1"
MAX_HEADER_BYTES = 1 << 28
MAX_BODY_BYTES = 1 << 36
# Rows are float32 by contract; outputs are whatever the expert computed in (float32 today).
_DTYPES: dict[str, np.dtype[Any]] = {"<f4": np.dtype("<f4"), "<f8": np.dtype("<f8")}
_REF_KINDS: dict[str, type[ExpertRef]] = {
    "expert": ExpertRef,
    "generator": GeneratorRef,
    "generated": GeneratedRef,
}
_KIND_OF = {cls: kind for kind, cls in _REF_KINDS.items()}


class ChannelError(Exception):
    """Base of the actor channel's errors (internal: the pool maps each to `ActorDied` or
    `ActorFailed`)."""


class WireError(ChannelError):
    """A frame that does not decode: wrong magic, sizes, JSON or field types."""


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    """(header length, body length) of a frame's prefix; `WireError` if it is not one."""
    magic, header_len, body_len = PREFIX.unpack(prefix)
    if magic != _MAGIC:
        raise WireError(f"not a momlp channel frame (magic {magic!r})")
    if header_len > MAX_HEADER_BYTES or body_len > MAX_BODY_BYTES:
        raise WireError(f"frame too large: header {header_len} B, body {body_len} B")
    return header_len, body_len


def encode_run(call: int, payload: Sequence[tuple[ExpertRef, np.ndarray]]) -> bytes:
    arrays = [np.ascontiguousarray(rows, dtype="<f4") for _, rows in payload]
    header = {
        "call": call,
        "groups": [
            [_ref_to_json(ref), list(rows.shape)]
            for (ref, _), rows in zip(payload, arrays, strict=True)
        ],
    }
    return _frame(header, arrays)


def decode_run(header: bytes, body: bytes) -> tuple[int, RunPayload]:
    fields = _load_header(header)
    try:
        call = _int(fields["call"])
        entries = fields["groups"]
        if not isinstance(entries, list):
            raise WireError("groups is not a list")
        refs = [_ref_from_json(entry[0]) for entry in entries]
        shapes = [_shape(entry[1], ndim=2) for entry in entries]
    except (KeyError, IndexError, TypeError) as exc:
        raise WireError(f"bad run header: {exc!r}") from None
    arrays = _split(body, [(_DTYPES["<f4"], shape) for shape in shapes])
    return call, [(ref, array) for ref, array in zip(refs, arrays, strict=True)]


def encode_reply(call: int, reply: ActorReply) -> bytes:
    arrays: list[np.ndarray] = []
    results = []
    for outcome in reply.results:
        entry: dict[str, Any] = {
            "expert_id": outcome.expert_id,
            "hit": outcome.hit,
            "load_ms": outcome.load_ms,
            "compute_ms": outcome.compute_ms,
            "expert_bytes": outcome.expert_bytes,
            "activation_bytes": outcome.activation_bytes,
            "error": outcome.error,
            "error_kind": outcome.error_kind,
            "key": outcome.key,
            "generator_bytes": outcome.generator_bytes,
            "outputs": None,
        }
        if outcome.outputs is not None:
            array = np.ascontiguousarray(outcome.outputs)
            dtype = array.dtype.newbyteorder("<").str
            if dtype not in _DTYPES:
                raise WireError(f"outputs of dtype {array.dtype} cannot be framed")
            arrays.append(array.astype(dtype, copy=False))
            entry["outputs"] = [dtype, list(array.shape)]
        results.append(entry)
    header = {
        "call": call,
        "actor": reply.actor,
        "device_bytes": reply.device_bytes,
        "resident": reply.resident,
        "evictions": reply.evictions,
        "results": results,
    }
    return _frame(header, arrays)


def encode_failure(call: int, reason: str) -> bytes:
    """The answer to a call whose `run` raised: the caller sees `reason`."""
    return _frame({"call": call, "failure": reason}, [])


def decode_reply(header: bytes, body: bytes) -> tuple[int, ActorReply | str]:
    """(call, the reply or a failure's reason)."""
    fields = _load_header(header)
    try:
        call = _int(fields["call"])
        if "failure" in fields:
            return call, _str(fields["failure"])
        entries = fields["results"]
        if not isinstance(entries, list):
            raise WireError("results is not a list")
        layouts = []
        for entry in entries:
            shape = entry["outputs"]
            if shape is not None:
                dtype = _DTYPES.get(shape[0])
                if dtype is None:
                    raise WireError(f"unknown dtype {shape[0]!r}")
                layouts.append((dtype, _shape(shape[1], ndim=2)))
        # Writable memory (one copy of the body) so the pool wraps each output as a tensor
        # without copying it (torch refuses to share read-only memory quietly).
        arrays = iter(_split(bytearray(body), layouts))
        outcomes = [
            GroupOutcome(
                expert_id=_int(entry["expert_id"]),
                outputs=None if entry["outputs"] is None else next(arrays),
                hit=_bool(entry["hit"]),
                load_ms=_float(entry["load_ms"]),
                compute_ms=_float(entry["compute_ms"]),
                expert_bytes=_int(entry["expert_bytes"]),
                activation_bytes=_int(entry["activation_bytes"]),
                error=_opt_str(entry["error"]),
                error_kind=_opt_str(entry["error_kind"]),
                key=_opt_str(entry["key"]),
                generator_bytes=_int(entry["generator_bytes"]),
            )
            for entry in entries
        ]
        resident = fields["resident"]
        if not isinstance(resident, dict):
            raise WireError("resident is not an object")
        reply = ActorReply(
            actor=_str(fields["actor"]),
            results=outcomes,
            device_bytes=_int(fields["device_bytes"]),
            resident={_str(key): _int(value) for key, value in resident.items()},
            evictions=_int(fields["evictions"]),
        )
    except (KeyError, IndexError, TypeError) as exc:
        raise WireError(f"bad reply header: {exc!r}") from None
    return call, reply


def _frame(header: dict[str, Any], arrays: Sequence[np.ndarray]) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join(array.tobytes() for array in arrays)
    return PREFIX.pack(_MAGIC, len(head), len(body)) + head + body


def _load_header(header: bytes) -> dict[str, Any]:
    try:
        fields = json.loads(header)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise WireError("header is not an object")
    return fields


def _split(
    body: bytes | bytearray, layouts: Sequence[tuple[np.dtype[Any], tuple[int, ...]]]
) -> list[np.ndarray]:
    arrays = []
    offset = 0
    for dtype, shape in layouts:
        # math.prod, not np.prod: a numpy reduction costs ~3 µs per array, on the event loop.
        count = math.prod(shape)
        size = dtype.itemsize * count
        if offset + size > len(body):
            raise WireError(f"body of {len(body)} B is shorter than its arrays")
        array = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
        arrays.append(array.reshape(shape))
        offset += size
    if offset != len(body):
        raise WireError(f"body of {len(body)} B is longer than its arrays ({offset} B)")
    return arrays


def _ref_to_json(ref: ExpertRef) -> dict[str, Any]:
    kind = _KIND_OF.get(type(ref))
    if kind is None:
        raise WireError(f"{type(ref).__name__} cannot be framed")
    fields: dict[str, Any] = {
        "kind": kind,
        "sha256": ref.sha256,
        "path": ref.path,
        "nbytes": ref.nbytes,
        "expert_id": ref.expert_id,
        "checksum": ref.checksum,
    }
    if isinstance(ref, GeneratedRef):
        fields["generator"] = _ref_to_json(ref.generator)
        fields["condition"] = base64.b64encode(ref.condition).decode("ascii")
        fields["spec_json"] = ref.spec_json
    return fields


def _ref_from_json(fields: Any) -> ExpertRef:
    if not isinstance(fields, dict):
        raise WireError("an expert ref is not an object")
    cls = _REF_KINDS.get(fields["kind"])
    if cls is None:
        raise WireError(f"unknown expert ref kind {fields['kind']!r}")
    sha256, path = _str(fields["sha256"]), _str(fields["path"])
    nbytes, expert_id = _int(fields["nbytes"]), _int(fields["expert_id"])
    checksum = _opt_str(fields["checksum"])
    if cls is GeneratedRef:
        generator = _ref_from_json(fields["generator"])
        if not isinstance(generator, GeneratorRef):
            raise WireError("a generated ref's generator is not a generator ref")
        try:
            condition = base64.b64decode(_str(fields["condition"]), validate=True)
        except ValueError as exc:
            raise WireError(f"bad condition: {exc}") from None
        return GeneratedRef(
            sha256,
            path,
            nbytes,
            expert_id,
            checksum,
            generator=generator,
            condition=condition,
            spec_json=_str(fields["spec_json"]),
        )
    return cls(sha256, path, nbytes, expert_id, checksum)


def _shape(value: Any, *, ndim: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != ndim:
        raise WireError(f"shape {value!r} is not {ndim} sizes")
    sizes = tuple(_int(size) for size in value)
    if min(sizes) < 0:
        raise WireError(f"negative size in shape {value!r}")
    return sizes


def _int(value: Any) -> int:
    if type(value) is not int:
        raise WireError(f"{value!r} is not an integer")
    return value


def _float(value: Any) -> float:
    if type(value) not in (int, float):
        raise WireError(f"{value!r} is not a number")
    return float(value)


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise WireError(f"{value!r} is not a boolean")
    return bool(value)


def _str(value: Any) -> str:
    if type(value) is not str:
        raise WireError(f"{value!r} is not a string")
    return value


def _opt_str(value: Any) -> str | None:
    return None if value is None else _str(value)
