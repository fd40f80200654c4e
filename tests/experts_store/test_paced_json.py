from __future__ import annotations

import json
from array import array
from typing import Any

import pytest

from experts_store import decode_json, decode_json_items, decode_json_member

pytestmark = pytest.mark.unit

DOCUMENTS = [
    '{"experts": [{"id": 0, "arch": {"widths": [2, 3]}}, {"id": 1}], "store_version": "v1"}',
    ' \n{ "a" : [ ] , "b":[1,[2,[3]],{"c":[4]}],\t"d":{}, "e":null }\r\n',
    '{"experts": [1, 2.5, -3e2, true, false, null, "x", [], {}]}',
    "{}",
    '{"k": "\\u00e9\\n\\"", "\\u00e9": ["\\ud83d\\ude00"]}',
    '{"dup": [1], "dup": [2, 3], "other": 1}',  # the last of a repeated key, as json.loads
    '{"big": 123456789012345678901234567890, "deep": [[[[[[1]]]]]]}',
    '[1, 2, {"a": [3]}]',  # not an object: decoded in one piece
    '"just a string"',
]


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


@pytest.mark.parametrize("text", DOCUMENTS)
def test_the_paced_decoder_gives_what_json_loads_gives(text: str) -> None:
    expected = json.loads(text)
    assert decode_json(text.encode()) == expected
    assert decode_json(text.encode(), Counter()) == expected


def test_the_pace_is_called_after_each_item_of_a_top_level_array() -> None:
    pace = Counter()
    decode_json(DOCUMENTS[0].encode(), pace)
    assert pace.calls == 2
    pace = Counter()
    decode_json(DOCUMENTS[1].encode(), pace)
    assert pace.calls == 3  # b's three items; a is empty and nested arrays are one item
    pace = Counter()
    decode_json(b'{"experts": ' + json.dumps(list(range(1000))).encode() + b"}", pace)
    assert pace.calls == 1000


BAD = [
    '{"a": [1, 2,]}',
    '{"a": [1 2]}',
    '{"a": [1, 2}',
    '{"a" 1}',
    '{"a": 1,}',
    "{'a': 1}",
    '{"a": 1} {"b": 2}',
    '{"a": 1} x',
    '{"a": [1]',
    '{"a": NaN}',
    '{"a": [Infinity]}',
    '{"a": [-Infinity]}',
    "",
    "{",
]


@pytest.mark.parametrize("text", BAD)
@pytest.mark.parametrize("paced", [False, True])
def test_what_is_not_json_is_a_value_error_paced_or_not(text: str, paced: bool) -> None:
    with pytest.raises(ValueError):
        decode_json(text.encode(), Counter() if paced else None)


@pytest.mark.parametrize("paced", [False, True])
def test_bytes_that_are_not_utf8_are_a_value_error(paced: bool) -> None:
    with pytest.raises(ValueError):
        decode_json(b'{"a": "\xff"}', Counter() if paced else None)


def test_a_refused_number_names_itself() -> None:
    with pytest.raises(ValueError, match="NaN"):
        decode_json(b'{"temperature": NaN}')


def _nested(depth: int) -> Any:
    return [] if depth == 0 else [_nested(depth - 1)]


def test_arrays_below_the_top_level_are_items_not_paced() -> None:
    pace = Counter()
    doc = {"a": [_nested(50), _nested(3)]}
    assert decode_json(json.dumps(doc).encode(), pace) == doc
    assert pace.calls == 2


@pytest.mark.parametrize("text", [d for d in DOCUMENTS if d.lstrip().startswith("{")])
@pytest.mark.parametrize("paced", [False, True])
def test_a_member_is_what_json_loads_gives_for_it(text: str, paced: bool) -> None:
    def first_of_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        kept: dict[str, Any] = {}
        for key, value in pairs:
            kept.setdefault(key, value)
        return kept

    # The first of a repeated key ("dup"); no document repeats a key below the top level.
    firsts = json.loads(text, object_pairs_hook=first_of_each)
    for key, expected in firsts.items():
        assert decode_json_member(text.encode(), key, Counter() if paced else None) == expected
    with pytest.raises(KeyError):
        decode_json_member(text.encode(), "no such member")


def test_a_member_is_decoded_without_what_comes_after_it() -> None:
    experts = json.dumps([{"id": i} for i in range(1000)])
    text = '{"format_version": 2, "store_version": "v7", "experts": ' + experts + "}"
    pace = Counter()
    assert decode_json_member(text.encode(), "store_version", pace) == "v7"
    assert pace.calls == 0
    # The start of the document is enough; a value the start cuts short is refused.
    head = text.encode()[: text.index('"experts"') + 20]
    assert decode_json_member(head, "store_version") == "v7"
    with pytest.raises(ValueError):
        decode_json_member(head, "experts")
    with pytest.raises(ValueError):
        decode_json_member(b'{"format_version": 12', "format_version")
    assert decode_json_member(b'{"format_version": 12}', "format_version") == 12


def test_members_after_the_experts_are_reached_at_a_pace() -> None:
    text = '{"experts": ' + json.dumps(list(range(100))) + ', "store_version": "v8"}'
    pace = Counter()
    assert decode_json_member(text.encode(), "store_version", pace) == "v8"
    assert pace.calls == 100


@pytest.mark.parametrize(
    "text", ['{"a": [1, 2,], "v": 1}', '{"a" 1, "v": 1}', "[1, 2]", '"v"', "", "{", '{"v": NaN}']
)
def test_a_document_that_is_not_an_object_up_to_the_member_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        decode_json_member(text.encode(), "v")


# decode_json_items: the same document, and where each item of one array lies in its text.


@pytest.mark.parametrize("text", DOCUMENTS)
@pytest.mark.parametrize("key", ["experts", "b", "dup", "absent"])
def test_items_decode_as_json_loads_and_their_spans_hold_them(text: str, key: str) -> None:
    expected = json.loads(text)
    pace = Counter()
    value, spans = decode_json_items(text.encode(), key, pace)
    assert value == expected
    paced_alone = Counter()
    decode_json(text.encode(), paced_alone)
    assert pace.calls == paced_alone.calls  # every top-level array's items, as decode_json
    items = expected.get(key) if isinstance(expected, dict) else None
    if not isinstance(items, list):
        assert len(spans) == 0
        return
    assert len(spans) == len(items)  # of "dup", the last, as json.loads
    for i, item in enumerate(items):
        start, end = spans.span(i)
        assert json.loads(spans.text[start:end]) == item
        assert spans.bounds(i, i + 1).tolist() == [start, end]


@pytest.mark.parametrize("text", BAD)
def test_what_is_not_json_is_a_value_error_with_items_tracked(text: str) -> None:
    with pytest.raises(ValueError):
        decode_json_items(text.encode(), "a", Counter())


def test_a_known_run_is_taken_as_given_and_the_rest_decoded() -> None:
    text = '{"experts": [ {"id": 0},\n {"id": 1}, {"id": 2} ,{"id": 3} ], "v": 1}'
    starts = [text.index(f'{{"id": {i}}}') for i in range(4)]
    asked: list[tuple[int, int]] = []

    def known(doc: str, index: int, at: int) -> tuple[list[Any], Any] | None:
        asked.append((index, at))
        if index != 1:
            return None
        # Items 1 and 2, stood in for by markers: the decoder takes the caller's word.
        ends = [starts[1] + 9, starts[2] + 9]
        return ["one", "two"], array("q", [starts[1], ends[0], starts[2], ends[1]])

    pace = Counter()
    value, spans = decode_json_items(text.encode(), "experts", pace, known)
    assert value == {"experts": [{"id": 0}, "one", "two", {"id": 3}], "v": 1}
    assert asked == [(0, starts[0]), (1, starts[1]), (3, starts[3])]
    assert pace.calls == 3  # one per decoded item, one for the run
    assert [json.loads(text[slice(*spans.span(i))]) for i in range(4)] == [
        {"id": i} for i in range(4)
    ]


def test_after_a_known_run_the_text_must_still_go_on_as_json() -> None:
    text = '{"experts": [{"id": 0} {"id": 1}]}'

    def known(doc: str, index: int, at: int) -> tuple[list[Any], Any] | None:
        return (["zero"], array("q", [at, at + 9])) if index == 0 else None

    with pytest.raises(ValueError, match="delimiter"):
        decode_json_items(text.encode(), "experts", Counter(), known)
