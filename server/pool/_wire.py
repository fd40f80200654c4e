"""The frames of an actor channel (`_channel`): one `run` call and its answer, without pickle.

A frame is a fixed prefix (magic, header length, body length), a JSON header, then a body of
raw little-endian arrays laid end to end in the order the header lists them. A request
names each group's `ExpertRef` by a number and its rows' shape; the ref itself travels once
per connection, in the first frame that uses it (`RunEncoder` on the server's end,
`RunDecoder` on the actor's: a batch names the same few hundred refs again and again, and
their JSON was most of a request's header). An answer carries an `ActorReply`, each
outcome's fields as one positional list with its output's shape, or a failure reason.
Decoding checks every field's type and that the arrays fill the body exactly, so a corrupt
frame is a `WireError`, never a wrong answer.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from experts_store import ExpertRef, GeneratedRef, GeneratorRef
from server.pool._errors import WireError
from server.pool._types import ActorReply, CacheCounts, GroupOutcome

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_HEADER_BYTES",
    "PREFIX",
    "RunPayload",
    "RunDecoder",
    "RunEncoder",
    "decode_reply",
    "encode_failure",
    "encode_reply",
    "parse_prefix",
]

RunPayload = list[tuple[ExpertRef, np.ndarray]]

PREFIX = struct.Struct("<4sIQ")
_MAGIC = b"MLW2"
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


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    """(header length, body length) of a frame's prefix; `WireError` if it is not one."""
    magic, header_len, body_len = PREFIX.unpack(prefix)
    if magic != _MAGIC:
        raise WireError(f"not a momlp channel frame (magic {magic!r})")
    if header_len > MAX_HEADER_BYTES or body_len > MAX_BODY_BYTES:
        raise WireError(f"frame too large: header {header_len} B, body {body_len} B")
    return header_len, body_len


class RunEncoder:
    """The server's end of one connection: run frames, each ref defined the first time.

    A ref is known by identity (a served model keeps one `ExpertRef` object per expert), so
    two equal-looking refs from two store versions stay two definitions, each with its own
    path. Past `max_refs` definitions both ends start over (`reset`), so a server that swaps
    store versions for months does not grow the tables without end; so does the next frame
    after `forget` (a new store version went live: the old one's refs, each a definition held
    at both ends, are of no more use, and until the cap the server grew ~17 KB a swap, ~490
    swaps in `benchmarks/server_memory.py`). Frames must reach the actor in the order they
    were encoded (the channel encodes and writes under one lock).
    """

    def __init__(self, max_refs: int = 4096) -> None:
        self._max_refs = max_refs
        # id(ref) -> (handle, ref): the ref is held so that its id is never reused.
        self._handles: dict[int, tuple[int, ExpertRef]] = {}
        self._forget = False

    def forget(self) -> None:
        """Start both ends' tables over at the next frame (a ref used again is defined
        again)."""
        self._forget = True

    def encode(self, call: int, payload: Sequence[tuple[ExpertRef, np.ndarray]]) -> bytes:
        arrays = [np.ascontiguousarray(rows, dtype="<f4") for _, rows in payload]
        handles = self._handles
        reset = self._forget or len(handles) + len(payload) > self._max_refs
        if reset:
            handles = {}
        fresh: dict[int, tuple[int, ExpertRef]] = {}
        groups = []
        defined = []
        for (ref, _), rows in zip(payload, arrays, strict=True):
            known = handles.get(id(ref)) or fresh.get(id(ref))
            if known is None:
                known = (len(handles) + len(fresh), ref)
                fresh[id(ref)] = known
                defined.append([known[0], _ref_to_json(ref)])
            groups.append([known[0], *rows.shape])
        header: dict[str, Any] = {"call": call, "refs": defined, "groups": groups}
        if reset:
            header["reset"] = True
        frame = _frame(header, arrays)
        # Only a frame that was built defines anything (a ref that cannot be framed raised).
        if reset:
            self._handles = handles
            self._forget = False
        handles.update(fresh)
        return frame


class RunDecoder:
    """The actor's end of one connection: the refs its frames defined so far."""

    def __init__(self) -> None:
        self._refs: dict[int, ExpertRef] = {}

    def decode(self, header: bytes, body: bytes) -> tuple[int, RunPayload]:
        fields = _load_header(header)
        try:
            call = _int(fields["call"])
            if fields.get("reset", False) is True:
                self._refs = {}
            defined, entries = fields["refs"], fields["groups"]
            if not isinstance(defined, list) or not isinstance(entries, list):
                raise WireError("refs or groups is not a list")
            for handle, ref in defined:
                self._refs[_int(handle)] = _ref_from_json(ref)
            refs = []
            shapes = []
            for handle, rows, cols in entries:
                ref = self._refs.get(_int(handle))
                if ref is None:
                    raise WireError(f"unknown ref {handle} (not defined on this connection)")
                refs.append(ref)
                shapes.append(_shape([rows, cols], ndim=2))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise WireError(f"bad run header: {exc!r}") from None
        arrays = _split(body, [(_DTYPES["<f4"], shape) for shape in shapes])
        return call, [(ref, array) for ref, array in zip(refs, arrays, strict=True)]


# An outcome's fields in the order of its positional list (the output's shape follows).
_OUTCOME = (
    "expert_id", "hit", "load_ms", "compute_ms", "expert_bytes", "activation_bytes",
    "error", "error_kind", "key", "generator_bytes",
)


def encode_reply(call: int, reply: ActorReply) -> bytes:
    arrays: list[np.ndarray] = []
    results = []
    for outcome in reply.results:
        entry: list[Any] = [
            outcome.expert_id, outcome.hit, outcome.load_ms, outcome.compute_ms,
            outcome.expert_bytes, outcome.activation_bytes, outcome.error,
            outcome.error_kind, outcome.key, outcome.generator_bytes,
        ]
        if outcome.outputs is None:
            entry.append(None)
        else:
            array = np.ascontiguousarray(outcome.outputs)
            dtype = array.dtype.newbyteorder("<").str
            if dtype not in _DTYPES:
                raise WireError(f"outputs of dtype {array.dtype} cannot be framed")
            arrays.append(array.astype(dtype, copy=False))
            entry.append([dtype, *array.shape])
        results.append(entry)
    header = {
        "call": call,
        "actor": reply.actor,
        "device_bytes": reply.device_bytes,
        "resident": reply.resident,
        "counts": [reply.counts.evictions, reply.counts.loads, reply.counts.load_bytes],
        "process": reply.process,
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
            if len(entry) != len(_OUTCOME) + 1:
                raise WireError(f"an outcome has {len(entry)} fields")
            shape = entry[-1]
            if shape is not None:
                dtype = _DTYPES.get(shape[0])
                if dtype is None:
                    raise WireError(f"unknown dtype {shape[0]!r}")
                layouts.append((dtype, _shape2(shape)))
        # Writable memory (one copy of the body) so the pool wraps each output as a tensor
        # without copying it (torch refuses to share read-only memory quietly).
        arrays = iter(_split(bytearray(body), layouts))
        outcomes = [_outcome(entry, arrays) for entry in entries]
        resident = fields["resident"]
        if not isinstance(resident, dict):
            raise WireError("resident is not an object")
        counts = fields["counts"]
        if not isinstance(counts, list) or len(counts) != 3:
            raise WireError("counts is not [evictions, loads, load_bytes]")
        reply = ActorReply(
            actor=_str(fields["actor"]),
            results=outcomes,
            device_bytes=_int(fields["device_bytes"]),
            resident={_str(key): _int(value) for key, value in resident.items()},
            counts=CacheCounts(*(_int(count) for count in counts)),
            process=_str(fields["process"]),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise WireError(f"bad reply header: {exc!r}") from None
    return call, reply


# The types each field of an outcome's list may have (the shape, last, was checked above).
_FIELD_TYPES: tuple[tuple[type, ...], ...] = (
    (int,), (bool,), (int, float), (int, float), (int,), (int,),
    (str, type(None)), (str, type(None)), (str, type(None)), (int,), (list, type(None)),
)
# Every combination of them: one set lookup checks an outcome's types, instead of a call per
# field (a reply has tens of outcomes, decoded on the event loop).
_GOOD_TYPES = frozenset(itertools.product(*_FIELD_TYPES))


def _outcome(entry: list[Any], arrays: Iterator[np.ndarray]) -> GroupOutcome:
    (
        expert_id, hit, load_ms, compute_ms, expert_bytes, activation_bytes,
        error, error_kind, key, generator_bytes, shape,
    ) = entry
    if tuple(map(type, entry)) not in _GOOD_TYPES:
        # A field of the wrong type: the per-field checks name it.
        _int(expert_id), _bool(hit), _float(load_ms), _float(compute_ms)
        _int(expert_bytes), _int(activation_bytes), _opt_str(error), _opt_str(error_kind)
        _opt_str(key), _int(generator_bytes)
        raise WireError(f"an outcome's shape {shape!r} is not a list")
    return GroupOutcome(
        expert_id, None if shape is None else next(arrays), hit, float(load_ms),
        float(compute_ms), expert_bytes, activation_bytes, error, error_kind, key,
        generator_bytes,
    )


def _frame(header: dict[str, Any], arrays: Sequence[np.ndarray]) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    # The arrays are C-contiguous: join reads their buffers without a copy each (an empty
    # array has no bytes to cast).
    body = b"".join(array.data.cast("B") if array.size else b"" for array in arrays)
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
        "file_bytes": ref.file_bytes,
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
    file_bytes = None if fields["file_bytes"] is None else _int(fields["file_bytes"])
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
            file_bytes,
            generator=generator,
            condition=condition,
            spec_json=_str(fields["spec_json"]),
        )
    return cls(sha256, path, nbytes, expert_id, checksum, file_bytes)


def _shape(value: Any, *, ndim: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != ndim:
        raise WireError(f"shape {value!r} is not {ndim} sizes")
    sizes = tuple(_int(size) for size in value)
    if min(sizes) < 0:
        raise WireError(f"negative size in shape {value!r}")
    return sizes


def _shape2(value: list[Any]) -> tuple[int, int]:
    """The [rows, cols] after a dtype in `value` (an output's shape: `_shape`, inlined for
    the tens of outputs a reply carries)."""
    if len(value) == 3:
        rows, cols = value[1], value[2]
        if type(rows) is int and type(cols) is int and rows >= 0 and cols >= 0:
            return rows, cols
    shape = _shape(value[1:], ndim=2)
    return shape[0], shape[1]


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
