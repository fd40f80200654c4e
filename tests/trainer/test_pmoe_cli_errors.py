"""`momlp build --kind pmoe` refuses options, patch shapes and .npy files it cannot train on
before training, each as one line naming the flag on stderr and exit status 2, never a
traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from server._cli import main
from trainer.pmoe import PMoEBuildConfig, PMoEConfigError, build_pmoe

pytestmark = pytest.mark.unit

SMALL = ["--dataset", "digits-patches", "--num-train", "40", "--num-test", "20"]


@pytest.fixture(autouse=True)
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build here must be refused before it trains anything."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr("trainer.pmoe._build.train_model", refuse)


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the build; assert exit 2, one stderr line, no store; return that line."""
    out = tmp_path / "store"
    code = main(["build", "--kind", "pmoe", "--out", str(out), "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("momlp build: "), err
    assert not out.exists()
    return err


def images(tmp_path: Path, x: np.ndarray | None = None) -> list[str]:
    """--data for 16x16 one-channel images (or `x`) with two classes."""
    rng = np.random.default_rng(0)
    x = rng.random((40, 16, 16, 1), dtype=np.float32) if x is None else x
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(len(x)) % 2)
    return ["--data", str(tmp_path / "x.npy"), str(tmp_path / "y.npy")]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lr", "-1"], "--lr: must be a positive number, got -1.0"),
        (["--lr", "0"], "--lr: must be a positive number, got 0.0"),
        (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
        (["--epochs", "-1"], "--epochs: must not be negative, got -1"),
        (["--router-epochs", "-1"], "--router-epochs: must not be negative, got -1"),
        (["--width", "0"], "--width: must be at least 1, got 0"),
        (["--train", "joint", "--experts", "0"], "--experts: must be at least 1, got 0"),
        (["--patches-per-expert", "0"], "--patches-per-expert: must be at least 1, got 0"),
        (["--test-fraction", "0"], "--test-fraction: must lie in (0, 1)"),
        (["--seed", str(2**32)], "--seed: must be in [0, 4294967295]"),
    ],
)
def test_an_option_out_of_range_is_refused_naming_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert says in refused(tmp_path, capsys, *SMALL, *argv)


def test_a_negative_seed_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code: object
    try:
        code = main(["build", "--kind", "pmoe", *SMALL, "--seed", "-1",
                     "--out", str(tmp_path / "store"), "--no-progress"])
    except SystemExit as exit_:  # the parser may refuse it first
        code = exit_.code
    assert code == 2
    assert "--seed" in capsys.readouterr().err
    with pytest.raises(PMoEConfigError, match="must be in") as caught:
        build_pmoe(PMoEBuildConfig(out=tmp_path / "s", seed=-1), progress=False)
    assert caught.value.option == "seed"


@pytest.mark.parametrize("shape", ["5x5", "32x32"])
def test_a_patch_shape_that_does_not_tile_the_images_names_their_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    err = refused(tmp_path, capsys, *images(tmp_path), "--patch-shape", shape)
    assert f"--patch-shape: 16x16 images (X [40, 16, 16, 1]) do not split into {shape}" in err


def test_a_patch_side_below_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(tmp_path, capsys, *images(tmp_path), "--patch-shape", "0x4")
    assert "--patch-shape: patch sides must be at least 1, got 0x4" in err


def test_values_beyond_float32_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.full((40, 4, 3), 1e300)
    err = refused(tmp_path, capsys, *images(tmp_path, x))
    assert "--data: X holds values beyond float32's range" in err


def test_a_huge_class_label_is_refused_before_it_sizes_the_output_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A label of 10**9 asked for an output layer of 10**9 units: killed for memory, no error.
    argv = images(tmp_path)
    y = np.arange(40) % 2
    y[7] = 10**9
    np.save(tmp_path / "y.npy", y)
    err = refused(tmp_path, capsys, *argv, "--patch-shape", "4x4")
    assert "largest, 1000000000 (row 7), asks for 1000000001 units; at most 65536" in err


def test_no_samples_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(tmp_path, capsys, *images(tmp_path, np.zeros((0, 4, 3))))
    assert "--data: X holds no samples" in err


@pytest.mark.parametrize("which", ["empty", "npz", "truncated"])
def test_an_unreadable_npy_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    data = images(tmp_path)
    x = Path(data[1])
    if which == "empty":
        x.write_bytes(b"")
        says = f"--data: cannot read {x}"
    elif which == "npz":
        np.savez(tmp_path / "x.npz", X=np.zeros((40, 4, 3)))
        x = tmp_path / "x.npz"
        says = f"--data: {x} is an .npz archive"
    else:
        x.write_bytes(x.read_bytes()[:200])
        says = f"--data: cannot read {x}"
    err = refused(tmp_path, capsys, "--data", str(x), data[2], "--patch-shape", "4x4")
    assert says in err


def test_a_patch_shape_for_data_already_in_patches_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was ignored: the store was built with the dataset's own patches.
    err = refused(tmp_path, capsys, *SMALL, "--patch-shape", "4x4")
    assert err.startswith("momlp build: --patch-shape: applies to image data given with --data")
    patches = np.random.default_rng(1).random((40, 16, 4), dtype=np.float32)  # [N, n, d]
    err = refused(tmp_path, capsys, *images(tmp_path, patches), "--patch-shape", "4x4")
    assert "X [40, 16, 4] is patches already" in err


def test_a_width_below_the_number_of_experts_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(tmp_path, capsys, *SMALL, "--train", "joint", "--experts", "8", "--width", "4")
    assert err == "momlp build: --width: must be at least the 8 experts its neurons are shared" \
        " among, got 4"
