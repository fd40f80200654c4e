"""Stores of kind "hyper": the manifest block, f and the conditions table on disk, θ as an
expert, the generated-θ cache key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.hyper as hyper
from experts_store import (
    ExpertFormatError,
    FrozenHyperNetwork,
    Manifest,
    Store,
    StoreWriter,
    condition_key,
    load_conditions,
    theta_expert,
)
from trainer.hyper import HyperNetwork, PrimarySpec

pytestmark = pytest.mark.unit


def _f(bias: bool = False, seed: int = 0) -> HyperNetwork:
    torch.manual_seed(seed)
    return HyperNetwork(3, PrimarySpec(4, (6, 5), 2, bias=bias), depth=1, width=16)


def test_publish_writes_content_named_files_the_manifest_references(tmp_path: Path) -> None:
    table = torch.randn(4, 3)
    manifest = hyper.publish_hypernetwork(tmp_path / "s", _f(), conditions=table,
                                    condition_ids=["w", "x", "y", "z"])
    spec = manifest.hyper
    assert manifest.kind == "hyper" and spec is not None and manifest.router_file is None
    assert manifest.num_experts == 0 and manifest.max_expert_bytes == 0
    assert spec.hypernetwork.file == f"hyper-{spec.hypernetwork.sha256[:16]}.safetensors"
    assert spec.conditions is not None and spec.conditions.count == 4
    assert manifest.referenced_files == {spec.hypernetwork.file, spec.conditions.file}
    assert sorted(p.name for p in (tmp_path / "s").glob("*.safetensors")) == sorted(
        manifest.referenced_files)
    values, ids = load_conditions(tmp_path / "s" / spec.conditions.file, spec.conditions.sha256)
    assert ids == ["w", "x", "y", "z"] and torch.equal(values, table)
    assert Store.open(tmp_path / "s").verify() == []


def test_a_republish_retires_the_files_two_versions_back_and_removes_them_later(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s"
    first = hyper.publish_hypernetwork(root, _f(seed=0))
    hyper.publish_hypernetwork(root, _f(seed=1))
    third = hyper.publish_hypernetwork(root, _f(seed=2))
    assert first.hyper is not None and third.hyper is not None
    old = first.hyper.hypernetwork.file
    ledger = json.loads((root / "retired.json").read_text())
    assert old in ledger["retired"] and (root / old).is_file()  # retired, not yet deleted
    # As if retired an hour ago: the next publish deletes it.
    ledger["retired"] = {name: 0.0 for name in ledger["retired"]}
    (root / "retired.json").write_text(json.dumps(ledger))
    fourth = hyper.publish_hypernetwork(root, _f(seed=3))
    names = {p.name for p in root.glob("hyper-*.safetensors")}
    assert old not in names and fourth.hyper is not None
    assert fourth.hyper.hypernetwork.file in names and third.hyper.hypernetwork.file in names


def test_verify_names_a_corrupted_hypernetwork(tmp_path: Path) -> None:
    manifest = hyper.publish_hypernetwork(tmp_path / "s", _f())
    assert manifest.hyper is not None
    path = tmp_path / "s" / manifest.hyper.hypernetwork.file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = Store.open(tmp_path / "s").verify()
    assert len(problems) == 1 and "hypernetwork" in problems[0].message
    assert "checksum" in problems[0].message


@pytest.mark.parametrize("bias", [False, True])
def test_theta_as_an_expert_equals_the_primary(tmp_path: Path, bias: bool) -> None:
    f = _f(bias=bias)
    manifest = hyper.publish_hypernetwork(tmp_path / "s", f)
    spec = manifest.hyper
    assert spec is not None
    net = FrozenHyperNetwork.load(tmp_path / "s" / spec.hypernetwork.file,
                                  expected_sha256=spec.hypernetwork.sha256)
    condition = torch.randn(3)
    expert = net.expert(condition, spec)
    x = torch.randn(50, 4)
    expected = hyper.primary_forward(x, hyper.generate(f, condition), f.primary)
    assert torch.allclose(expert(x), expected, rtol=0, atol=1e-6)
    flat = f.flat_theta(condition[None])[0].detach()
    assert torch.equal(net.flat(condition[None])[0], flat)  # same ops, same bits
    assert expert.nbytes() == spec.theta_nbytes == theta_expert(flat, spec).nbytes()


def test_the_cache_key_is_the_condition_bytes_under_f() -> None:
    c = np.array([0.0, 1.5, -2.0], dtype=np.float32)
    key = condition_key("a" * 64, c)
    assert key == condition_key("a" * 64, torch.from_numpy(c))
    assert key == condition_key("a" * 64, np.array([-0.0, 1.5, -2.0], dtype=np.float32))
    assert key != condition_key("b" * 64, c)
    assert key != condition_key("a" * 64, np.nextafter(c, np.float32(9)))


def test_the_block_must_match_the_kind_and_the_primary(tmp_path: Path) -> None:
    manifest = hyper.publish_hypernetwork(tmp_path / "s", _f())
    data = json.loads(manifest.model_dump_json())
    with pytest.raises(ValueError, match="hyper block"):
        Manifest.model_validate({**data, "kind": "momlp", "router_file": None})
    bad = json.loads(json.dumps(data))
    bad["hyper"]["layout"][1]["offset"] += 1
    with pytest.raises(ValueError, match="layout"):
        Manifest.model_validate(bad)
    bad = json.loads(json.dumps(data))
    bad["hyper"]["hypernetwork"]["file"] = "../hyper-0000000000000000.safetensors"
    with pytest.raises(ValueError, match="hypernetwork file"):
        Manifest.model_validate(bad)


def test_a_momlp_store_still_needs_its_router(tmp_path: Path) -> None:
    with StoreWriter(tmp_path / "s") as writer, pytest.raises(Exception, match="router"):
        writer.publish(task="regression", input_dim=2, output_dim=1, routing="tree",
                       branching=2)


def test_a_hyper_version_opened_after_a_momlp_one_keeps_none_of_its_rows(tmp_path: Path) -> None:
    from experts_store_helpers import publish

    root = tmp_path / "s"
    publish(root, num_experts=4)
    served = Store.open(root)
    assert len(served.expert_refs()) == 4
    hyper.publish_hypernetwork(root, _f(), conditions=torch.randn(2, 3), condition_ids=["a", "b"])
    store = Store.open(root, previous=served)
    # Nothing of the momlp version is held for refs that a store without rows never makes.
    assert store._prior_refs is None
    assert store.manifest.kind == "hyper" and store.expert_refs() == []


def test_f_with_nan_weights_is_refused_where_it_is_loaded(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    manifest = hyper.publish_hypernetwork(tmp_path / "s", _f())
    assert manifest.hyper is not None
    path = tmp_path / "s" / manifest.hyper.hypernetwork.file
    tensors = load_file(str(path))
    tensors["layers.1.bias"][0] = float("nan")
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        metadata = json.loads(f.read(size))["__metadata__"]
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ExpertFormatError, match="its weights hold NaN or infinite values"):
        FrozenHyperNetwork.load(path)


def test_f_or_a_table_that_is_not_numbers_is_not_written(tmp_path: Path) -> None:
    from experts_store import StoreWriteError, save_conditions, save_hypernetwork

    weight, bias = torch.zeros(4, 3), torch.zeros(4)
    bias[2] = float("inf")
    with pytest.raises(StoreWriteError, match="layers.0.bias holds NaN or infinite values"):
        save_hypernetwork([(weight, bias)], tmp_path / "f.safetensors")
    table = torch.zeros(2, 3)
    table[1, 1] = float("nan")
    with pytest.raises(StoreWriteError, match="the conditions table holds NaN or infinite"):
        save_conditions(table, ["a", "b"], tmp_path / "c.safetensors")
    assert list(tmp_path.iterdir()) == []
