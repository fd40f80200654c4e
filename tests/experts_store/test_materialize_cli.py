"""`momlp store materialize SRC --out DIR` (experts_store/_cli.py, _materialize.py): where no
store can be written, a one-line error before any expert is generated, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experts_store import Store, StoreError, materialize_store
from router import PrototypeTree
from server._cli import main
from trainer.hyper import HyperNetwork, PrimarySpec, publish_hypernetwork

pytestmark = pytest.mark.unit

EXPERTS = 5


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A prototype-conditioned hyper store of EXPERTS prototypes in R^3."""
    torch.manual_seed(0)
    f = HyperNetwork(3, PrimarySpec(3, (4,), 2), depth=1, width=8)
    prototypes = torch.randn(EXPERTS, 3, generator=torch.Generator().manual_seed(1))
    root = tmp_path / "hyper"
    publish_hypernetwork(root, f, conditions=prototypes,
                         condition_ids=[str(k) for k in range(EXPERTS)],
                         router=PrototypeTree.build(prototypes, branching=2, seed=0))
    return root


def test_materialize_writes_one_expert_per_prototype(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["store", "materialize", str(source), "--out", str(tmp_path / "plain")]) == 0
    assert f"materialized {EXPERTS} experts" in capsys.readouterr().out
    assert Store.open(tmp_path / "plain").manifest.num_experts == EXPERTS


def _refused(source: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["store", "materialize", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out {out}: ") and "\n" not in err
    return err


def test_an_existing_file_as_out_is_refused_and_left_alone(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    assert _refused(source, out, capsys).endswith("exists and is not a directory")
    assert out.read_text() == "keep me"


def test_out_under_a_file_is_refused(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = tmp_path / "notes.txt"
    parent.write_text("keep me")
    err = _refused(source, parent / "store", capsys)
    assert err.endswith(f"{parent} is not a directory")


def test_the_source_store_as_out_is_refused_and_keeps_serving_its_kind(
    source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = Store.open(source).version
    assert "is the source store" in _refused(source, source, capsys)
    store = Store.open(source)
    assert store.version == version and store.manifest.kind == "hyper"


def test_the_library_refuses_the_same_outs_as_store_errors(source: Path, tmp_path: Path) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me")
    with pytest.raises(StoreError, match="exists and is not a directory"):
        materialize_store(source, afile)
    with pytest.raises(StoreError, match="cannot write a store at"):
        materialize_store(source, afile / "store")
    with pytest.raises(StoreError, match="is the source store"):
        materialize_store(source, source)
