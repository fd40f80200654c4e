"""What an actor's loader remembers of the contents it checked stays bounded: a server that
loads new contents for weeks (hot swaps of retrained stores) does not keep one entry for
every content it ever met, and a content in use is not forgotten."""

from __future__ import annotations

from pathlib import Path

import pytest
from experts_store_helpers import publish

import experts_store._ref as ref_module
from experts_store import ExpertRefLoader, Store
from experts_store._recent import RecentKeys

pytestmark = pytest.mark.unit


def test_recent_keys_hold_at_most_two_generations() -> None:
    keys = RecentKeys(4)
    for key in range(100):
        keys.add(key)
    assert len(keys) <= 8
    assert 99 in keys and 0 not in keys


def test_a_key_in_use_is_kept_while_others_come_and_go() -> None:
    keys = RecentKeys(4)
    keys.add("hot")
    for key in range(100):
        assert "hot" in keys  # looked up between additions, as a content loaded again
        keys.add(key)
    assert "hot" in keys and 0 not in keys


def test_recent_keys_need_room_for_one() -> None:
    with pytest.raises(ValueError, match="capacity"):
        RecentKeys(0)


def test_a_loader_remembers_a_bounded_number_of_contents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three stores' worth of distinct contents (as hot swaps of retrained stores bring) with
    # room to remember four per generation: the loader's memory stays within two of them.
    monkeypatch.setattr(ref_module, "_REMEMBERED_CONTENTS", 4, raising=False)
    loader = ExpertRefLoader("cpu")
    for seed in range(3):
        root = tmp_path / f"store-{seed}"
        publish(root, num_experts=6, seed=seed + 1)
        store = Store.open(root)
        for ref in store.expert_refs():
            loader.load(ref)
    assert len(loader._finite) <= 8
    assert len(loader._verified) <= 8
