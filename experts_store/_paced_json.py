"""JSON decoding of manifest.json that can give the GIL back between an array's items.

`json.loads` of a K=100,000 manifest (43 MB) is one C call that holds the GIL for 0.6 s. With
a `Pace`, each array under the top-level object (the experts) is decoded an item at a time,
calling the pace after each: the same scanner, the same result and the same errors as one
`loads`, in slices. NaN and ±Infinity, which `json` would accept and no writer of a store
emits, are refused either way.
"""

from __future__ import annotations

import json
from json.decoder import WHITESPACE, scanstring  # type: ignore[attr-defined]
from typing import Any

from experts_store._pace import Pace

__all__ = ["decode_json"]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def decode_json(raw: bytes, pace: Pace | None = None) -> Any:
    """The document in UTF-8 `raw`; ValueError (JSONDecodeError, UnicodeDecodeError) if it
    is not JSON. `pace` is called after each item of a top-level object's arrays."""
    text = raw.decode("utf-8")
    if pace is None:
        return _DECODER.decode(text)
    start = _skip(text, 0)
    if text[start : start + 1] != "{":
        return _DECODER.decode(text)
    obj, end = _paced_object(text, start + 1, pace)
    end = _skip(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return obj


def _skip(text: str, at: int) -> int:
    end: int = WHITESPACE.match(text, at).end()
    return end


def _paced_object(text: str, at: int, pace: Pace) -> tuple[dict[str, Any], int]:
    """The object whose '{' precedes `at`, and the index after its '}'."""
    obj: dict[str, Any] = {}
    at = _skip(text, at)
    if text[at : at + 1] == "}":
        return obj, at + 1
    while True:
        if text[at : at + 1] != '"':
            raise json.JSONDecodeError(
                "Expecting property name enclosed in double quotes", text, at
            )
        key, at = scanstring(text, at + 1, True)
        at = _skip(text, at)
        if text[at : at + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
        at = _skip(text, at + 1)
        if text[at : at + 1] == "[":
            obj[key], at = _paced_array(text, at + 1, pace)
        else:
            obj[key], at = _DECODER.raw_decode(text, at)
        closed, at = _after_item(text, at, "}")
        if closed:
            return obj, at


def _paced_array(text: str, at: int, pace: Pace) -> tuple[list[Any], int]:
    """The array whose '[' precedes `at`, and the index after its ']'."""
    items: list[Any] = []
    at = _skip(text, at)
    if text[at : at + 1] == "]":
        return items, at + 1
    while True:
        item, at = _DECODER.raw_decode(text, at)
        items.append(item)
        pace()
        closed, at = _after_item(text, at, "]")
        if closed:
            return items, at


def _after_item(text: str, at: int, close: str) -> tuple[bool, int]:
    """After an item: (True, index after `close`) at the end of its container, else (False,
    index of the next item)."""
    at = _skip(text, at)
    if text[at : at + 1] == close:
        return True, at + 1
    if text[at : at + 1] != ",":
        raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
    return False, _skip(text, at + 1)
