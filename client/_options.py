"""A request's options checked before sending: top_k, mode, the gate, a hyper store's conditions.

Checked here, once, so that a JSON body and a binary body's query string get the same verdict
(a beam width of 1.5 was refused in JSON but cut to 1 in a query string) and a wrong type is an
`InputError`, never a bare TypeError from building the body.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from ._encoding import rows_from_sequences
from ._exceptions import InputError

__all__ = [
    "CONDITION_FIELDS",
    "GATE_FIELDS",
    "check_conditions",
    "check_gate",
    "check_generate",
    "check_options",
    "gate_query",
]

GATE_FIELDS = ("temperature", "min_weight", "top_p", "beam", "score")
CONDITION_FIELDS = ("conditions", "condition", "condition_ids")
_GATE_NUMBERS = ("temperature", "min_weight", "top_p")


def check_options(top_k: int, mode: str | None) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise InputError(f"top_k must be an integer >= 1, got {top_k!r}", top_k=top_k)
    if mode not in (None, "tree", "exact"):
        raise InputError(f"mode must be 'tree', 'exact' or None, got {mode!r}", mode=mode)


def check_gate(gate: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The request-time gate as the server takes it: unknown fields, numbers that are not
    finite numbers, and beam widths that are not whole numbers >= 1 are refused here; ranges
    and the server's caps are the server's to check (its 422 names them)."""
    if gate is None:
        return None
    unknown = sorted(set(gate) - set(GATE_FIELDS))
    if unknown:
        raise InputError(f"unknown gate fields {unknown}; known: {list(GATE_FIELDS)}",
                         gate=dict(gate))
    checked: dict[str, Any] = {}
    for name, value in gate.items():
        if value is None:
            continue
        if name in _GATE_NUMBERS:
            checked[name] = _finite(f"gate {name}", value, field=name)
        elif name == "beam":
            checked[name] = _beam(value)
        elif isinstance(value, str):
            checked[name] = value
        else:
            raise InputError(f"gate score must be 'sqdist' or 'dist', got {value!r}",
                             field="score")
    return checked


def check_conditions(conditions: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A hyper store's conditions: one of {"conditions": rows}, {"condition": values},
    {"condition_ids": names}; arrays become lists, numbers are checked finite (a NaN would
    reach the server as a number it refuses under another name), and a single name is one
    name for every row (not its letters, one per row)."""
    if not conditions:
        return None
    unknown = sorted(set(conditions) - set(CONDITION_FIELDS))
    if unknown or len(conditions) != 1:
        raise InputError(f"give one of {list(CONDITION_FIELDS)}, got {sorted(conditions)}",
                         conditions=sorted(conditions))
    ((name, value),) = conditions.items()
    if name == "condition_ids":
        return {name: _names(value)}
    if hasattr(value, "tolist") and not isinstance(value, list | tuple):
        value = value.tolist()
    if name == "conditions":
        try:
            return {name: rows_from_sequences(value, what="conditions")}
        except InputError as exc:
            raise InputError(exc.message, field=name) from None
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise InputError(f"condition must be a non-empty list of numbers, got {value!r}",
                         field=name)
    return {name: [_finite("a condition value", number, field=name) for number in value]}


def check_generate(condition: Any, condition_id: str | None) -> dict[str, Any]:
    """`/v1/generate`'s body: exactly one of a condition's values and a name of the table."""
    if (condition is None) == (condition_id is None):
        raise InputError("give exactly one of condition and condition_id", field="condition")
    if condition_id is not None:
        if not isinstance(condition_id, str) or not condition_id:
            raise InputError(f"condition_id must be a name, got {condition_id!r}",
                             field="condition_id")
        return {"condition_id": condition_id}
    checked = check_conditions({"condition": condition})
    assert checked is not None  # a condition was given
    return checked


def gate_query(gate: Mapping[str, Any] | None) -> dict[str, str]:
    """A checked gate as query parameters of a binary body (beam comma-separated)."""
    if not gate:
        return {}
    return {k: ",".join(str(w) for w in v) if k == "beam" else str(v) for k, v in gate.items()}


def _finite(what: str, value: Any, *, field: str) -> float:
    # numpy scalars expose __float__; strings and bools are refused as the server's JSON is.
    if isinstance(value, str | bytes | bool) or not hasattr(value, "__float__"):
        raise InputError(f"{what} must be a number, got {value!r}", field=field)
    try:
        number = float(value)
    except OverflowError:  # an int of hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise InputError(f"{what} must be finite, got {value!r}", field=field)
    return number


def _beam(value: Any) -> list[int]:
    """Beam widths per tree level; one width is that width at every level."""
    if hasattr(value, "tolist") and not isinstance(value, list | tuple):
        value = value.tolist()
    widths = value if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    if not widths:
        raise InputError("gate beam needs at least one width", field="beam")
    return [_width(width) for width in widths]


def _width(value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # what the server's JSON takes as whole
    try:
        if isinstance(value, bool):
            raise TypeError
        width = operator.index(value)
    except TypeError:
        raise InputError(f"gate beam widths must be whole numbers, got {value!r}",
                         field="beam") from None
    if width < 1:
        raise InputError(f"gate beam widths must be >= 1, got {width}", field="beam")
    return width


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if hasattr(value, "tolist") and not isinstance(value, list | tuple):
        value = value.tolist()
    if not isinstance(value, Sequence) or not value or not all(
        isinstance(name, str) for name in value
    ):
        raise InputError(f"condition_ids must be a name or a list of names, got {value!r}",
                         field="condition_ids")
    return list(value)
