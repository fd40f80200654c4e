"""`momlp build --kind hyper`: train f on (X, I, y) and publish a store of kind "hyper"."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from experts_store import FrozenHyperNetwork, Store
from server._cli import main

pytestmark = pytest.mark.unit


def _triples(path: Path, rows: int = 400, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    cond = rng.normal(size=(rows, 2)).astype(np.float32)
    y = (x[:, :2] * cond).sum(axis=1)
    np.savez(path, X=x, I=cond, y=y)
    return path


def test_build_hyper_from_data_then_info_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "store"
    code = main([
        "build", "--kind", "hyper", "--data", str(_triples(tmp_path / "t.npz")),
        "--depth", "1", "--epochs", "2", "--baseline", "embedding", "--named-conditions", "5",
        "--out", str(out), "--no-progress",
    ])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["kind"] == "hyper" and summary["theta_params"] == 3 * 10 + 10
    assert summary["hypernetwork"]["metric"] == "mse" and summary["baseline"]["metric"] == "mse"
    assert summary["named_conditions"] == 5
    store = Store.open(out)
    spec = store.manifest.hyper
    assert spec is not None and spec.input_dim == 3 and spec.condition_dim == 2
    assert spec.hypernetwork.widths == [2, 100, 100, 40]
    net = FrozenHyperNetwork.load(out / spec.hypernetwork.file)
    assert net.flat(torch.zeros(1, 2)).shape == (1, 40)
    assert main(["store", "verify", str(out)]) == 0
    assert main(["store", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hypernetwork and its conditions verified" in text and "primary g  3-10-1" in text
    # A flipped byte in f: named as the hypernetwork's file, not as a router or "expert -1".
    f_path = out / spec.hypernetwork.file
    raw = bytearray(f_path.read_bytes())
    raw[-5] ^= 0xFF
    f_path.write_bytes(bytes(raw))
    assert main(["store", "verify", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"FAIL hypernetwork {spec.hypernetwork.file}: checksum mismatch")
    assert "expert -1" not in lines[0] and "router" not in lines[0]
    assert lines[-1] == "no expert fails; the store's own files above do"


def test_build_hyper_refuses_momlp_options_and_bad_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _triples(tmp_path / "t.npz")
    assert main(["build", "--kind", "hyper", "--data", str(data), "--experts", "4",
                 "--out", str(tmp_path / "a"), "--no-progress"]) == 2
    assert "--experts does not apply" in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    np.savez(bad, X=np.zeros((10, 3)), y=np.zeros(10))
    assert main(["build", "--kind", "hyper", "--data", str(bad),
                 "--out", str(tmp_path / "b"), "--no-progress"]) == 2
    assert "X, I and y" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
