"""JSON decoding of manifest.json that can give the GIL back between an array's items.

`json.loads` of a K=100,000 manifest (43 MB) is one C call that holds the GIL for 0.6 s. With
a `Pace`, each array under the top-level object (the experts) is decoded an item at a time,
calling the pace after each: the same scanner, the same result and the same errors as one
`loads`, in slices. NaN and ±Infinity, which `json` would accept and no writer of a store
emits, are refused either way. `decode_json_member` decodes a top-level object only up to one
member (the store watcher's `store_version`, near the top).
"""

from __future__ import annotations

import json
from json.decoder import WHITESPACE, scanstring  # type: ignore[attr-defined]
from typing import Any

from experts_store._pace import Pace

__all__ = ["decode_json", "decode_json_member"]


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


def decode_json_member(raw: bytes, key: str, pace: Pace | None = None) -> Any:
    """The value of member `key` of the object that UTF-8 `raw` holds, decoding only the
    members before it: a manifest's `store_version` (its second member) without its 100,000
    experts. `raw` may be the start of a longer document, as long as it runs past the member.

    KeyError: the object has no such member (first come, where `json.loads` keeps the last
    of two). ValueError: `raw` is not an object, or not JSON up to and just past the member.
    """
    text = raw.decode("utf-8")
    at = _skip(text, 0)
    if text[at : at + 1] != "{":
        raise json.JSONDecodeError("Expecting an object", text, at)
    at = _skip(text, at + 1)
    if text[at : at + 1] == "}":
        raise KeyError(key)
    while True:
        # `_member` reads the ',' or '}' after the value: a value cut short by the end of a
        # prefix (a number's first digits) is refused, not taken.
        name, value, closed, at = _member(text, at, pace)
        if name == key:
            return value
        if closed:
            raise KeyError(key)


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
        key, value, closed, at = _member(text, at, pace)
        obj[key] = value
        if closed:
            return obj, at


def _member(text: str, at: int, pace: Pace | None) -> tuple[str, Any, bool, int]:
    """The member of an object at `at` (its key's '"'): key, value, and as `_after_item`.
    With a `pace`, an array value is decoded an item at a time."""
    if text[at : at + 1] != '"':
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
    key, at = scanstring(text, at + 1, True)
    at = _skip(text, at)
    if text[at : at + 1] != ":":
        raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
    at = _skip(text, at + 1)
    if pace is not None and text[at : at + 1] == "[":
        value, at = _paced_array(text, at + 1, pace)
    else:
        value, at = _DECODER.raw_decode(text, at)
    closed, at = _after_item(text, at, "}")
    return key, value, closed, at


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
