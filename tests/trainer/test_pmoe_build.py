"""`momlp build --kind pmoe` and trainer.pmoe's publishing: the store's files are the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from experts_store import PMOE_ROUTER_TENSOR, Store, load_expert
from server._cli import main
from trainer.pmoe import PMoEBuildConfig, build_pmoe, predict_logits

pytestmark = pytest.mark.unit

TINY = ["--epochs", "2", "--router-epochs", "2", "--no-progress"]


def image_data(tmp_path: Path, count: int = 120) -> tuple[Path, Path]:
    """[N, 6, 4, 1] images of 3x2 patches (n = 4, d = 6); the class is the brightest corner."""
    rng = np.random.default_rng(0)
    x = rng.random((count, 6, 4, 1), dtype=np.float32) * 0.2
    y = np.arange(count) % 2
    x[y == 1, :3, :2] += 0.8
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y.astype(np.int64))
    return tmp_path / "x.npy", tmp_path / "y.npy"


def logits_from_files(root: Path, x: np.ndarray) -> np.ndarray:
    """Expert choice read straight from the store's files, in float64 (independent code)."""
    manifest = json.loads((root / "manifest.json").read_text())
    spec = manifest["pmoe"]
    n, d, top = spec["layout"]["num_patches"], spec["layout"]["patch_dim"], spec[
        "patches_per_expert"
    ]
    w = load_file(str(root / manifest["router_file"]))[PMOE_ROUTER_TENSOR].astype(np.float64)
    patches = x.reshape(len(x), n, d).astype(np.float64)
    padded = np.zeros((len(x), n, manifest["experts"][0]["arch"]["widths"][0]))
    padded[..., :d] = patches
    out = np.zeros((len(x), manifest["output_dim"]))
    for s, entry in enumerate(manifest["experts"]):
        expert = load_expert(root / entry["file"])
        scores = patches @ w[s]  # [B, n]
        chosen = np.argsort(-scores, axis=1, kind="stable")[:, :top]
        picked = np.take_along_axis(scores, chosen, axis=1)
        if spec["gating"] == "softmax":
            gates = np.exp(picked - picked.max(1, keepdims=True))
            gates /= gates.sum(1, keepdims=True)
        else:
            gates = np.ones_like(picked)
        with torch.no_grad():
            per_patch = expert(torch.from_numpy(padded.reshape(-1, padded.shape[-1])).float())
        per_patch = per_patch.double().numpy().reshape(len(x), n, -1)
        taken = np.take_along_axis(per_patch, chosen[..., None], axis=1)
        out += (taken * gates[..., None]).sum(axis=1)
    return out


def test_momlp_build_kind_pmoe_trains_publishes_and_store_tools_cover_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = image_data(tmp_path)
    out = tmp_path / "store"
    code = main([
        "build", "--kind", "pmoe", "--data", str(x), str(y), "--patch-shape", "3x2",
        "--out", str(out), "--experts", "2", "--patches-per-expert", "2",
        "--train", "separate", "--baseline", "cnn", *TINY,
    ])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["kind"] == "pmoe" and summary["baseline"]["model"] == "cnn"
    assert main(["store", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "pmoe"
    assert info["pmoe"]["layout"]["image"] == {
        "height": 6, "width": 4, "channels": 1, "patch_height": 3, "patch_width": 2,
    }
    assert info["input_dim"] == 24 and info["pmoe"]["patches_per_expert"] == 2
    assert main(["store", "verify", str(out)]) == 0
    assert main(["store", "info", str(out)]) == 0
    assert "expert_choice l=2" in capsys.readouterr().out


@pytest.mark.parametrize("train", ["separate", "joint"])
def test_the_published_files_compute_the_trained_model(tmp_path: Path, train: str) -> None:
    x, y = image_data(tmp_path)
    build = build_pmoe(
        PMoEBuildConfig(out=tmp_path / train, dataset=None, data=(x, y), patch_shape=(3, 2),
                        train=train, num_experts=2 if train == "separate" else 3,
                        patches_per_expert=2, epochs=2, router_epochs=2),  # type: ignore[arg-type]
        progress=False,
    )
    offline = predict_logits(build.model, build.x_test).numpy()
    flat = build.x_test.reshape(len(build.x_test), -1).numpy()
    assert np.abs(logits_from_files(tmp_path / train, flat) - offline).max() <= 1e-5
    assert Store.open(tmp_path / train).verify() == []


def test_options_of_the_other_kind_and_bad_data_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = image_data(tmp_path)
    out = str(tmp_path / "store")
    pmoe = ["build", "--kind", "pmoe", "--out", out, *TINY]
    assert main([*pmoe, "--dataset", "digits-patches", "--branching", "4"]) == 2
    assert "--branching" in capsys.readouterr().err
    assert main(["build", "--dataset", "digits", "--out", out, "--train", "joint"]) == 2
    assert "--train does not apply to --kind momlp" in capsys.readouterr().err
    assert main([*pmoe, "--data", str(x), str(y)]) == 2
    assert "--patch-shape" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.full(120, 5.0))
    assert main([*pmoe, "--data", str(x), str(tmp_path / "bad.npy"), "--patch-shape", "3x2"]) == 2
    assert "integer labels" in capsys.readouterr().err
    assert main([*pmoe, "--dataset", "digits-patches", "--train", "separate",
                 "--experts", "3"]) == 2
    assert "one expert per class" in capsys.readouterr().err
    assert not (tmp_path / "store" / "manifest.json").exists()
