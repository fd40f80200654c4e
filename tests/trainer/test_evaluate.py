from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from experts_store import Store, StoreWriter
from server._cli import main

pytestmark = pytest.mark.unit

_BUILD = [
    "build", "--dataset", "ackley2d", "--executor", "local", "--experts", "4",
    "--branching", "2", "--grid-size", "12", "--width", "16", "--epochs", "2",
    "--prototype-epochs", "1", "--no-progress", "--no-baseline",
]


@pytest.fixture
def staged_link_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Expert 0's staged file, once trained and registered, made a link to a copy outside
    the store (registration refuses a link out of the store itself: tests/experts_store/
    test_writer.py; this is a link made after it, which the evaluation reads)."""
    outside = tmp_path / "outside" / "expert-0.safetensors"
    outside.parent.mkdir()
    register = StoreWriter.register_expert_file

    def linked(self: StoreWriter, expert_id: int) -> object:
        entry = register(self, expert_id)
        if expert_id == 0:
            staged = self.expert_path(0)
            shutil.move(staged, outside)
            os.symlink(outside, staged)
        return entry

    monkeypatch.setattr(StoreWriter, "register_expert_file", linked)
    return outside


def test_a_staged_expert_linked_out_of_the_store_fails_the_build_as_serving_would(
    tmp_path: Path, staged_link_out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The build's evaluation read the file through the link and published the store, whose
    # expert 0 every server then refused (503): its report scored a file never served.
    out = tmp_path / "store"
    assert main([*_BUILD, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "momlp build: evaluating expert 0 failed" in err
    assert "is a link that leads outside the store" in err
    assert not out.exists()  # nothing published, no staging left behind
    assert staged_link_out.is_file()  # the file the link led to is left as it was


def test_experts_linked_within_the_store_are_evaluated_and_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A link that stays inside the store is served, so the build must keep taking it.
    register = StoreWriter.register_expert_file

    def linked(self: StoreWriter, expert_id: int) -> object:
        if expert_id == 0:
            staged = self.expert_path(0)
            kept = self.root / "kept-expert-0.safetensors"
            shutil.move(staged, kept)
            os.symlink(kept, staged)
        return register(self, expert_id)

    monkeypatch.setattr(StoreWriter, "register_expert_file", linked)
    out = tmp_path / "store"
    assert main([*_BUILD, "--out", str(out)]) == 0
    store = Store.open(out)
    store.load_expert(0)
