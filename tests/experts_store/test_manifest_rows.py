"""A republished manifest's unchanged rows are taken from the one read before it."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from experts_store_helpers import make_expert, publish, stand_in_router
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from experts_store import (
    ExpertArch,
    Manifest,
    ManifestError,
    Store,
    StoreWriter,
    read_manifest_rows,
)

pytestmark = pytest.mark.unit

K = 40


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("rows") / "store"
    publish(root, num_experts=K)
    loaded: dict[str, Any] = json.loads((root / "manifest.json").read_text())
    return loaded


def text_of(data: dict[str, Any]) -> bytes:
    return json.dumps(data, indent=2).encode()


def changed_row(row: dict[str, Any], salt: int) -> dict[str, Any]:
    """The row with another (valid) content hash, as a republished expert of new weights."""
    sha = f"{salt:016x}" * 4
    return row | {"sha256": sha, "file": f"experts/{row['id']}-{sha[:16]}.safetensors",
                  "checksum": f"xxh3_128:{salt:032x}"}


def taken(new: Manifest, old: Manifest) -> list[int]:
    """Ids of the rows of `new` that are `old`'s own objects."""
    return [a.id for a, b in zip(new.experts, old.experts, strict=False) if a is b]


def test_an_unchanged_republish_takes_every_row_and_says_where_each_lies(
    data: dict[str, Any],
) -> None:
    first, rows = read_manifest_rows(text_of(data))
    # A longer version string: every row sits further into the text than before.
    republished = data | {"store_version": data["store_version"] + "-republished-again"}
    second, second_rows = read_manifest_rows(text_of(republished), previous=rows)
    assert taken(second, first) == list(range(K))
    assert second == Manifest.model_validate(republished)
    for i, entry in enumerate(second.experts):
        start, end = second_rows.spans.span(i)
        assert json.loads(second_rows.spans.text[start:end]) == republished["experts"][i]
        assert entry.model_dump() == republished["experts"][i]
    # And a third read, after the second, takes them again.
    third, _ = read_manifest_rows(text_of(data), previous=second_rows)
    assert taken(third, first) == list(range(K))


def test_a_changed_row_is_read_anew_and_the_others_are_taken(data: dict[str, Any]) -> None:
    first, rows = read_manifest_rows(text_of(data))
    experts = list(data["experts"])
    for i in (0, 17, K - 1):
        experts[i] = changed_row(experts[i], i + 1)
    republished = data | {"experts": experts}
    second, _ = read_manifest_rows(text_of(republished), previous=rows)
    assert taken(second, first) == [i for i in range(K) if i not in (0, 17, K - 1)]
    assert second == Manifest.model_validate(republished)
    assert second.experts[17].sha256 == experts[17]["sha256"] != first.experts[17].sha256


def test_rows_added_or_removed_at_the_end(data: dict[str, Any]) -> None:
    first, rows = read_manifest_rows(text_of(data))
    more = data | {"num_experts": K + 1,
                   "experts": [*data["experts"], changed_row(data["experts"][0], 9) | {
                       "id": K, "file": f"experts/{K}-{9:016x}.safetensors"}]}
    second, _ = read_manifest_rows(text_of(more), previous=rows)
    assert taken(second, first) == list(range(K)) and second == Manifest.model_validate(more)
    fewer = data | {"num_experts": K - 5, "experts": data["experts"][: K - 5]}
    third, _ = read_manifest_rows(text_of(fewer), previous=rows)
    assert taken(third, first) == list(range(K - 5)) and third == Manifest.model_validate(fewer)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        # A changed row is checked as any row is.
        (lambda d: d["experts"][5].update(sha256="not hex"), "experts.5.sha256"),
        (lambda d: d["experts"][5].update(file="/etc/passwd"), "expert 5: file"),
        (lambda d: d["experts"][5].update(params=1), "expert 5: params"),
        # A taken row still passes the checks across rows and against the store's fields.
        (lambda d: d.update(input_dim=5), "expert 0: arch maps 3 -> 2, store maps 5 -> 2"),
        (lambda d: d.update(num_experts=K + 1), "ids must be exactly"),
        (lambda d: d["experts"].reverse(), "ids must be exactly"),
    ],
)
def test_what_a_fresh_read_refuses_is_refused_after_a_previous_one(
    data: dict[str, Any], edit: Any, match: str
) -> None:
    _, rows = read_manifest_rows(text_of(data))
    bad = json.loads(text_of(data))
    edit(bad)
    for previous in (None, rows):
        with pytest.raises(ManifestError, match=match) as info:
            read_manifest_rows(text_of(bad), previous=previous)
        # The package's own error, in one line; pydantic's is its cause.
        assert isinstance(info.value.__cause__, ValidationError)
        assert info.value.root is None and "\n" not in str(info.value)


def test_a_released_previous_gives_no_rows(data: dict[str, Any]) -> None:
    first, rows = read_manifest_rows(text_of(data))
    rows.entries.clear()  # what a retired version's release does to its manifest's list
    second, _ = read_manifest_rows(text_of(data), previous=rows)
    assert taken(second, Manifest.model_validate(data)) == []
    assert second == Manifest.model_validate(data)


def test_a_row_of_equal_value_but_other_text_is_read_anew(data: dict[str, Any]) -> None:
    # Another layout of the same rows: nothing taken (the text is what is compared), the same
    # manifest all the same.
    first, rows = read_manifest_rows(text_of(data))
    second, _ = read_manifest_rows(json.dumps(data).encode(), previous=rows)
    assert taken(second, first) == [] and second == first


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), changes=st.integers(0, K))
def test_any_set_of_changed_rows_reads_as_a_fresh_read_does(
    data: dict[str, Any], seed: int, changes: int
) -> None:
    rng = random.Random(seed)
    first, rows = read_manifest_rows(text_of(data))
    which = set(rng.sample(range(K), changes))
    experts = [changed_row(r, rng.randrange(1, 2**60)) if r["id"] in which else r
               for r in data["experts"]]
    republished = data | {"experts": experts, "store_version": "v" * rng.randrange(1, 40)}
    second, _ = read_manifest_rows(text_of(republished), previous=rows)
    assert second == Manifest.model_validate(republished)
    assert set(taken(second, first)) == set(range(K)) - which


def fields(ref: Any) -> tuple[Any, ...]:
    return ref.sha256, ref.path, ref.nbytes, ref.expert_id, ref.checksum


def test_a_store_opened_after_another_takes_its_rows_and_refs(tmp_path: Path) -> None:
    root = tmp_path / "store"
    publish(root, num_experts=6, seed=1)
    served = Store.open(root)
    served_refs = served.expert_refs()
    # Republished by the writer: five experts' files kept, expert 2 retrained.
    with StoreWriter(root) as writer:
        for entry in served.manifest.experts:
            if entry.id == 2:
                writer.add_expert(2, make_expert((3, 8, 2), seed=77))
            else:
                writer.link_expert_file(entry.id, root / entry.file)
        writer.router_path.write_bytes(stand_in_router(6, 3, seed=1))
        writer.publish(task="regression", input_dim=3, output_dim=2, routing="tree", branching=2)
    second = Store.open(root, previous=served)
    refs = second.expert_refs()
    assert taken(second.manifest, served.manifest) == [0, 1, 3, 4, 5]
    assert [a is b for a, b in zip(refs, served_refs, strict=True)] == [
        True, True, False, True, True, True
    ]
    assert [fields(r) for r in refs] == [fields(second.expert_ref(i)) for i in range(6)]
    assert refs[2].sha256 == second.manifest.experts[2].sha256 != served_refs[2].sha256
    assert second.load_expert(2).arch == served.manifest.experts[2].expert_arch
    # Another root: the rows are taken, each ref made anew with its own path.
    other = tmp_path / "copy"
    other.mkdir()
    (other / "manifest.json").write_text((root / "manifest.json").read_text())
    elsewhere = Store.open(other, previous=second)
    assert taken(elsewhere.manifest, second.manifest) == list(range(6))
    moved = elsewhere.expert_refs()
    assert all(r.path.startswith(f"{other.absolute()}/experts/") for r in moved)
    assert [fields(r) for r in moved] == [fields(elsewhere.expert_ref(i)) for i in range(6)]


def test_entries_taken_keep_their_shared_arch(data: dict[str, Any]) -> None:
    first, rows = read_manifest_rows(text_of(data))
    second, _ = read_manifest_rows(text_of(data), previous=rows)
    assert second.experts[3].expert_arch == ExpertArch(widths=(3, 8, 2))
    assert second.experts[3].arch is first.experts[4].arch
