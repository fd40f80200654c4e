"""JSON decoding of manifest.json that can give the GIL back between an array's items.

`json.loads` of a K=100,000 manifest (43 MB) is one C call that holds the GIL for 0.6 s. With
a `Pace`, each array under the top-level object (the experts) is decoded an item at a time,
calling the pace after each: the same scanner, the same result and the same errors as one
`loads`, in slices. NaN and ±Infinity, which `json` would accept and no writer of a store
emits, are refused either way. `decode_json_member` decodes a top-level object only up to one
member (the store watcher's `store_version`, near the top). `decode_json_items` also says where
each item of one such array lies in the text, and takes an item it already knows from an
earlier document without decoding it (a swap's unchanged manifest rows).
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Callable, Sequence
from json.decoder import WHITESPACE, scanstring  # type: ignore[attr-defined]
from typing import Any

from experts_store._pace import Pace, no_pace

__all__ = ["ItemSpans", "KnownItems", "decode_json", "decode_json_items", "decode_json_member"]

# (text, index of the next item, where it starts) -> the values of the items from there on that
# it knows, and their spans in the text (start, end of each); or None: decode that item.
KnownItems = Callable[[str, int, int], "tuple[Sequence[Any], array[int]] | None"]


class ItemSpans:
    """Where each item of one array of a JSON document lies in the document's text."""

    __slots__ = ("_bounds", "text")

    def __init__(self, text: str, bounds: array[int] | None = None) -> None:
        self.text = text
        self._bounds = bounds if bounds is not None else array("q")  # start, end of each item

    def __len__(self) -> int:
        return len(self._bounds) // 2

    def span(self, index: int) -> tuple[int, int]:
        """Item `index`'s text is `text[start:end]`."""
        return self._bounds[2 * index], self._bounds[2 * index + 1]

    def bounds(self, first: int, stop: int) -> array[int]:
        """The spans of items `first` to `stop - 1`, flat: start, end of each."""
        return self._bounds[2 * first : 2 * stop]


class _Tracked:
    """The array member `decode_json_items` reports on, and what it has found of it."""

    def __init__(self, key: str, text: str, known: KnownItems | None) -> None:
        self.key = key
        self.known = known
        self.spans = ItemSpans(text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def decode_json(raw: bytes, pace: Pace | None = None) -> Any:
    """The document in UTF-8 `raw`; ValueError (JSONDecodeError, UnicodeDecodeError) if it
    is not JSON. `pace` is called after each item of a top-level object's arrays."""
    text = raw.decode("utf-8")
    if pace is None:
        return _DECODER.decode(text)
    return _paced_document(text, pace, None)


def decode_json_items(
    raw: bytes, key: str, pace: Pace | None = None, known: KnownItems | None = None
) -> tuple[Any, ItemSpans]:
    """As `decode_json`, and where each item of the top-level object's member `key` (an
    array) lies in the text; no items if the document has no such array (of a key given twice,
    the last, as `json.loads` keeps). That array is decoded an item at a time, `pace` called
    after each. `known(text, i, at)` may give the values and spans of items `i`, `i + 1`, ...
    without decoding them, when it knows the text from `at` to be those items and the commas
    between them (an earlier document's): the caller's word is taken for it, and `pace` is
    called once after the run."""
    text = raw.decode("utf-8")
    tracked = _Tracked(key, text, known)
    return _paced_document(text, pace, tracked), tracked.spans


def _paced_document(text: str, pace: Pace | None, tracked: _Tracked | None) -> Any:
    """The document in `text`, a top-level object's arrays an item at a time (`_member`)."""
    start = _skip(text, 0)
    if text[start : start + 1] != "{":
        return _DECODER.decode(text)
    obj, end = _paced_object(text, start + 1, pace, tracked)
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


def _paced_object(
    text: str, at: int, pace: Pace | None, tracked: _Tracked | None = None
) -> tuple[dict[str, Any], int]:
    """The object whose '{' precedes `at`, and the index after its '}'."""
    obj: dict[str, Any] = {}
    at = _skip(text, at)
    if text[at : at + 1] == "}":
        return obj, at + 1
    while True:
        key, value, closed, at = _member(text, at, pace, tracked)
        obj[key] = value
        if closed:
            return obj, at


def _member(
    text: str, at: int, pace: Pace | None, tracked: _Tracked | None = None
) -> tuple[str, Any, bool, int]:
    """The member of an object at `at` (its key's '"'): key, value, and as `_after_item`.
    With a `pace`, an array value is decoded an item at a time; so is the `tracked` one."""
    if text[at : at + 1] != '"':
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
    key, at = scanstring(text, at + 1, True)
    at = _skip(text, at)
    if text[at : at + 1] != ":":
        raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
    at = _skip(text, at + 1)
    if tracked is not None and key == tracked.key and text[at : at + 1] == "[":
        value, at = _paced_array(text, at + 1, pace or no_pace, tracked)
    elif pace is not None and text[at : at + 1] == "[":
        value, at = _paced_array(text, at + 1, pace)
    else:
        value, at = _DECODER.raw_decode(text, at)
    closed, at = _after_item(text, at, "}")
    return key, value, closed, at


def _paced_array(
    text: str, at: int, pace: Pace, tracked: _Tracked | None = None
) -> tuple[list[Any], int]:
    """The array whose '[' precedes `at`, and the index after its ']', `pace` called after each
    item. The `tracked` array also records each item's span and takes the runs its `known`
    knows. This loop is most of a K=100,000 manifest's decode: the scanner is called directly
    and the separator found by one regex, 0.47 s where a `raw_decode` and a separator check an
    item took 0.53 s (benchmarks/RESULTS.md, fifty-ninth session)."""
    items: list[Any] = []
    bounds: array[int] = array("q")
    known = tracked.known if tracked is not None else None
    scan = _DECODER.scan_once  # type: ignore[attr-defined]  # set by JSONDecoder.__init__
    at = _skip(text, at)
    closed = text[at : at + 1] == "]"
    if closed:
        at += 1
    while not closed:
        run = known(text, len(items), at) if known is not None else None
        if run is None or not run[0]:
            try:
                item, end = scan(text, at)
            except StopIteration as err:
                raise json.JSONDecodeError("Expecting value", text, err.value) from None
            items.append(item)
            bounds.append(at)
            bounds.append(end)
        else:
            items.extend(run[0])
            bounds.extend(run[1])
            end = run[1][-1]
        pace()
        after = _NEXT_ITEM.match(text, end)
        if after is None:
            raise json.JSONDecodeError("Expecting ',' delimiter", text, _skip(text, end))
        at = after.end()
        closed = after.group(1) is None  # the array's ']'
    if tracked is not None:
        tracked.spans = ItemSpans(text, bounds)  # a key given again replaces the first's
    return items, at


# After an array's item: a comma and the whitespace after it (group 1), or the closing ']'.
_NEXT_ITEM = re.compile(r"[ \t\n\r]*(?:(,)[ \t\n\r]*|\])")


def _after_item(text: str, at: int, close: str) -> tuple[bool, int]:
    """After an item: (True, index after `close`) at the end of its container, else (False,
    index of the next item)."""
    at = _skip(text, at)
    if text[at : at + 1] == close:
        return True, at + 1
    if text[at : at + 1] != ",":
        raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
    return False, _skip(text, at + 1)
