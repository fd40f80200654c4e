"""Calibrated temperature: `momlp build` fits τ on held-out rows, `momlp store calibrate`
republishes a store with a τ fitted on a data file (trainer/_calibrate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experts_store import Store
from router import PrototypeTree
from server._cli import main
from trainer import BuildConfig, ackley, build_store, quick_overrides

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calib") / "store"
    config = BuildConfig(
        out=out, dataset="ackley2d", experts=8, branching=4, executor="local",
        **{**quick_overrides("ackley2d"), "grid_size": 24},
    )
    build_store(config, progress=False)
    return out


@pytest.fixture
def store(built: Path, tmp_path: Path) -> Path:
    """A copy of the built store, for a test that changes it."""
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(built, copy)
    return copy


def test_build_chooses_tau_from_held_out_rows_and_says_how(built: Path) -> None:
    m = Store.open(built).manifest
    gate = m.gate_spec
    assert gate.temperature_source == "calibrated" and gate.tree_top_k == "beam"
    assert gate.calibration is not None
    c = gate.calibration
    assert c["data"] == "the build's held-out test split" and c["top_k"] == [2, 3]
    # The chosen τ is the grid's best: no worse than τ = 1 on the rows it was fitted on.
    for k in ("2", "3"):
        assert c["loss_at_temperature"][k] <= c["loss_at_1"][k]
    # One-standard-error rule: the smallest τ within one SE of the grid's best.
    assert gate.temperature <= c["best_temperature"]
    mean_loss = sum(c["loss_at_temperature"].values()) / 2
    assert mean_loss <= c["loss_at_best"] + c["standard_error_at_temperature"] + 1e-12
    assert PrototypeTree.load(Store.open(built).router_path).temperature == gate.temperature


def test_store_calibrate_republishes_with_the_same_experts(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = Store.open(built).manifest
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, size=(600, 2))
    np.savez(tmp_path / "fit.npz", X=x, y=ackley(x).reshape(-1, 1))
    assert main(["store", "calibrate", str(built), "--data", str(tmp_path / "fit.npz")]) == 0
    after = Store.open(built).manifest
    assert after.store_version != before.store_version
    assert [e.sha256 for e in after.experts] == [e.sha256 for e in before.experts]
    c = after.gate_spec.calibration
    assert c is not None and c["data"] == "fit.npz" and c["rows"] == 600
    assert after.temperature == after.gate_spec.temperature != before.temperature
    assert "calibrated τ=" in capsys.readouterr().out
    assert main(["store", "info", str(built), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gate"]["temperature_source"] == "calibrated"


def test_store_calibrate_refuses_a_store_without_a_top_k_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from graph_support import D, tiny_graph_store

    root = tmp_path / "graph"
    tiny_graph_store(root)
    before = Store.open(root).manifest.store_version
    rng = np.random.default_rng(6)
    np.savez(tmp_path / "fit.npz", X=rng.uniform(-1, 1, size=(50, D)), y=rng.normal(size=50))
    assert main(["store", "calibrate", str(root), "--data", str(tmp_path / "fit.npz")]) == 1
    err = capsys.readouterr().err
    assert "kind 'graph'" in err and "Traceback" not in err
    assert Store.open(root).manifest.store_version == before  # nothing republished


def test_store_calibrate_reads_a_table_by_its_target_column(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --help promised .csv rows, and a table needs --target, which calibrate did not take.
    pytest.importorskip("pandas")
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, size=(300, 2))
    table = tmp_path / "fit.csv"
    rows = [f"{a},{b},{t}" for (a, b), t in zip(x, ackley(x).ravel(), strict=True)]
    table.write_text("a,b,t\n" + "\n".join(rows) + "\n")
    assert main(["store", "calibrate", str(built), "--data", str(table), "--target", "t"]) == 0
    c = Store.open(built).manifest.gate_spec.calibration
    assert c is not None and c["data"] == "fit.csv" and c["rows"] == 300
    assert "calibrated τ=" in capsys.readouterr().out


def test_store_calibrate_refuses_to_undo_a_version_published_while_it_ran(
    built: Path, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It relinked the experts of the version it had read: a build published meanwhile was
    # silently replaced by the old experts, and both commands said they succeeded.
    import trainer._calibrate as calibrate
    from experts_store import StoreWriter

    real_fit = calibrate.fit_temperature

    def fit_while_a_build_publishes(*args: object, **kwargs: object) -> object:
        fit = real_fit(*args, **kwargs)  # type: ignore[arg-type]
        m = Store.open(store).manifest
        with StoreWriter(store) as writer:
            for entry in m.experts:
                writer.link_expert_file(entry.id, store / entry.file)
            writer.router_path.write_bytes((store / str(m.router_file)).read_bytes())
            writer.publish(task=m.task, input_dim=m.input_dim, output_dim=m.output_dim,
                           routing=m.routing, branching=m.branching, gate=m.gate_spec)
        return fit

    monkeypatch.setattr(calibrate, "fit_temperature", fit_while_a_build_publishes)
    rng = np.random.default_rng(6)
    x = rng.uniform(-1, 1, size=(300, 2))
    np.savez(tmp_path / "fit.npz", X=x, y=ackley(x).reshape(-1, 1))
    before = Store.open(store).version
    assert main(["store", "calibrate", str(store), "--data", str(tmp_path / "fit.npz")]) == 1
    after = Store.open(store)
    assert after.version != before
    err = capsys.readouterr().err
    assert f"it started from version {before}, and version {after.version} is live now" in err
    assert "nothing was published" in err
    # The build's version stays live, with its own gate, not the calibration's.
    assert after.manifest.gate_spec == Store.open(built).manifest.gate_spec


def test_store_calibrate_on_a_store_it_cannot_write_says_so_before_fitting(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It fitted first (minutes on a large store) and only then found the store read-only.
    import errno

    import experts_store._writer as writer_module
    import trainer._calibrate as calibrate

    fitted: list[object] = []
    monkeypatch.setattr(calibrate, "fit_temperature", lambda *a, **k: fitted.append(a))

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(writer_module.FileLock, "take", read_only)
    x = np.random.default_rng(7).uniform(-1, 1, size=(100, 2))
    np.savez(tmp_path / "fit.npz", X=x, y=ackley(x).reshape(-1, 1))
    before = Store.open(store).version
    assert main(["store", "calibrate", str(store), "--data", str(tmp_path / "fit.npz")]) == 1
    err = capsys.readouterr().err
    assert "Read-only file system" in err and "nothing was published" in err
    assert fitted == []
    assert Store.open(store).version == before


def test_store_calibrate_refuses_targets_wider_than_the_stores_outputs(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.random.default_rng(8).uniform(-1, 1, size=(60, 2))
    np.savez(tmp_path / "wide.npz", X=x, y=np.zeros((60, 3)))  # was a RuntimeError traceback
    before = Store.open(built).version
    assert main(["store", "calibrate", str(built), "--data", str(tmp_path / "wide.npz")]) == 1
    err = capsys.readouterr().err
    assert "y has 3 columns, the store's experts output 1" in err and "Traceback" not in err
    assert Store.open(built).version == before


def test_store_calibrate_asks_for_rows_not_a_split_and_refuses_a_top_k_it_cannot_fit(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = Store.open(built).version
    x = np.random.default_rng(9).uniform(-1, 1, size=(1, 2))
    np.savez(tmp_path / "one.npz", X=x, y=ackley(x).reshape(-1, 1))
    assert main(["store", "calibrate", str(built), "--data", str(tmp_path / "one.npz")]) == 1
    err = capsys.readouterr().err
    # Was "1 rows are too few to split into train and test": calibrate splits nothing.
    assert "calibration needs at least 2 rows" in err and "split" not in err

    x = np.random.default_rng(10).uniform(-1, 1, size=(60, 2))
    np.savez(tmp_path / "fit.npz", X=x, y=ackley(x).reshape(-1, 1))
    for top_k, outside in (("2,9", "[9]"), ("1,3", "[1]")):
        args = ["store", "calibrate", str(built), "--data", str(tmp_path / "fit.npz")]
        assert main([*args, "--top-k", top_k]) == 1
        err = capsys.readouterr().err
        # k = 9 was dropped without a word (K = 8), and τ fitted for the rest.
        assert f"top_k must lie in 2..8 (the store's K), got {outside}" in err
    assert Store.open(built).version == before


def test_store_calibrate_fits_on_rows_of_one_class_of_a_classifier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sklearn.datasets import load_digits

    store = tmp_path / "digits"
    config = BuildConfig(out=store, dataset="digits", experts=4, branching=2, executor="local",
                         **quick_overrides("digits"))
    build_store(config, progress=False)
    digits = load_digits()
    sevens = digits.target == 7
    np.savez(tmp_path / "sevens.npz", X=digits.data[sevens] / 16.0, y=digits.target[sevens])
    # Was refused: "classification needs at least 2 classes", from a split calibrate never used.
    assert main(["store", "calibrate", str(store), "--data", str(tmp_path / "sevens.npz")]) == 0
    c = Store.open(store).manifest.gate_spec.calibration
    assert c is not None and c["rows"] == int(sevens.sum())
    # Scored against class "7" of the store: any other class would cost ln(10)/row and more.
    assert c["loss_top1"] < 0.5


def test_a_store_of_two_experts_builds_and_calibrates_for_top_2_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The default (2, 3) met a K = 2 store: the build failed after training every expert
    # ("top_k must lie in 2..2, got [3]"), and calibrate asked for --top-k 2.
    store = tmp_path / "two"
    config = BuildConfig(out=store, dataset="ackley2d", experts=2, branching=2,
                         executor="local", **{**quick_overrides("ackley2d"), "grid_size": 24})
    build_store(config, progress=False)
    c = Store.open(store).manifest.gate_spec.calibration
    assert c is not None and c["top_k"] == [2]
    x = np.random.default_rng(11).uniform(-1, 1, size=(60, 2))
    np.savez(tmp_path / "fit.npz", X=x, y=ackley(x).reshape(-1, 1))
    args = ["store", "calibrate", str(store), "--data", str(tmp_path / "fit.npz")]
    assert main(args) == 0
    assert Store.open(store).manifest.gate_spec.calibration["top_k"] == [2]
    assert main([*args, "--top-k", "3"]) == 1  # named, and beyond K: refused
    assert "top_k must lie in 2..2 (the store's K), got [3]" in capsys.readouterr().err
