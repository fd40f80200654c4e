from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server._cli import main
from trainer._cli import register


@pytest.mark.unit
def test_registration_imports_only_the_standard_library() -> None:
    code = (
        "import sys, trainer._cli as c; "
        "heavy = {'torch', 'numpy', 'ray', 'experts_store', 'router'} & set(sys.modules); "
        "print(sorted(heavy))"
    )
    # trainer/__init__ is heavy, so import the CLI module by path without the package init.
    out = subprocess.run(
        [sys.executable, "-c", code.replace("import sys, trainer._cli as c", _LOAD_BY_PATH)],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "[]"


_CLI_FILE = Path(__file__).parents[2] / "trainer" / "_cli.py"
_LOAD_BY_PATH = (
    "import sys, importlib.util as u; "
    f"s = u.spec_from_file_location('tcli', {str(_CLI_FILE)!r}); "
    "c = u.module_from_spec(s); s.loader.exec_module(c)"
)


@pytest.mark.unit
def test_build_parser_accepts_the_documented_command() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["build", "--dataset", "ackley2d", "--experts", "16", "--branching", "4", "--out", "d"]
    )
    assert (args.dataset, args.experts, args.branching, args.out) == ("ackley2d", 16, 4, Path("d"))
    assert callable(args.handler)


@pytest.mark.unit
def test_bad_data_exits_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, X=np.full((30, 2), np.nan), y=np.zeros(30))
    code = main(["build", "--data", str(bad), "--out", str(tmp_path / "s"), "--no-progress"])
    assert code == 2
    assert "NaN" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("kind", ["hyper", "pmoe"])
def test_a_fifo_for_data_is_refused_not_read_for_ever(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    import os

    fifo = tmp_path / ("f.npz" if kind == "hyper" else "f.npy")
    os.mkfifo(fifo)
    np.save(tmp_path / "y.npy", np.zeros(8, dtype=np.int64))
    data = [str(fifo)] if kind == "hyper" else [str(fifo), str(tmp_path / "y.npy")]
    code = main(["build", "--kind", kind, "--data", *data, "--out", str(tmp_path / "s"),
                 "--no-progress", "--quick"])
    assert code == 2
    err = capsys.readouterr().err
    assert "f.np" in err and "not a regular file" in err, err
    assert not (tmp_path / "s").exists()


def test_inputs_beyond_what_the_router_can_take_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.random.default_rng(0).uniform(-1, 1, (60, 2)) * 1e20  # finite, even as float32
    np.savez(tmp_path / "big.npz", X=x, y=np.zeros(60))
    code = main(["build", "--data", str(tmp_path / "big.npz"), "--out", str(tmp_path / "s"),
                 "--no-progress", "--quick", "--executor", "local", "--experts", "2",
                 "--branching", "2", "--no-baseline"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("momlp build: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "s").exists()


@pytest.mark.ray
def test_momlp_build_then_store_verify(
    ray_session: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "store"
    code = main([
        "build", "--dataset", "rastrigin2d", "--quick", "--experts", "4", "--branching", "2",
        "--grid-size", "12", "--width", "16", "--epochs", "2", "--prototype-epochs", "1",
        "--out", str(out), "--no-progress",
    ])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_experts"] == 4 and summary["mixture"]["metric"] == "mse"
    assert main(["store", "verify", str(out)]) == 0


_WITHOUT_RAY = """
import json, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            raise ImportError("ray is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
from server._cli import main
out = sys.argv[1]
code = main([
    "build", "--dataset", "ackley2d", "--executor", "local", "--experts", "4",
    "--branching", "2", "--grid-size", "12", "--width", "16", "--epochs", "2",
    "--prototype-epochs", "1", "--out", out, "--no-progress",
])
verify = main(["store", "verify", out])
print(json.dumps({"build": code, "verify": verify, "ray": "ray" in sys.modules}))
"""


@pytest.mark.unit
def test_the_local_executor_builds_a_store_where_ray_cannot_be_imported(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_RAY, str(tmp_path / "store")],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "build": 0, "verify": 0, "ray": False
    }
    report = json.loads((tmp_path / "store" / "report.json").read_text())
    assert report["config"]["executor"] == "local"
    assert len(report["experts"]) == 4 and report["baseline"]["metric"] == "mse"


@pytest.mark.unit
def test_ray_only_options_are_refused_with_the_local_executor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([
        "build", "--dataset", "ackley2d", "--executor", "local", "--num-cpus", "2",
        "--out", str(tmp_path / "s"), "--no-progress",
    ])
    assert code == 2
    assert "--num-cpus: only with --executor ray" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.unit
def test_a_validation_fraction_outside_0_1_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([
        "build", "--dataset", "ackley2d", "--select-epoch", "best-validation",
        "--validation-fraction", "1.5", "--out", str(tmp_path / "s"), "--no-progress",
    ])
    assert code == 2
    assert "--validation-fraction: must lie in (0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


class _TrainingReached(Exception):
    pass


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the build's training entry fail the test if the handler gets that far."""
    import trainer

    def build_store(config: Any, **_: Any) -> None:
        # The --out check must leave no directory behind for a build that fails later.
        assert not Path(config.out).exists()
        raise _TrainingReached

    monkeypatch.setattr(trainer, "build_store", build_store)


def _build_into(out: str) -> int:
    return main(["build", "--dataset", "ackley2d", "--executor", "local", "--out", out,
                 "--no-progress"])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("out", "reason"),
    [
        ("afile", "exists and is not a directory"),
        ("afile/sub", "afile is not a directory"),
        pytest.param("/proc/nope", "cannot create /proc/nope",
                     marks=pytest.mark.skipif(not Path("/proc").is_dir(), reason="no /proc")),
    ],
)
def test_an_unusable_out_exits_2_before_any_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    no_training: None, out: str, reason: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a store")
    assert _build_into(out) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()]  # one line, no traceback
    assert f"--out {out}: " in err and reason in err
    assert (tmp_path / "afile").read_text() == "not a store"


@pytest.mark.unit
def test_a_creatable_out_reaches_training_without_being_created_yet(
    tmp_path: Path, no_training: None
) -> None:
    with pytest.raises(_TrainingReached):
        _build_into(str(tmp_path / "new" / "store"))
    assert not (tmp_path / "new").exists()


@pytest.mark.unit
@pytest.mark.parametrize("threads", ["0", "-2", "two"])
def test_torch_threads_below_one_is_refused_by_the_parser(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], threads: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["build", "--dataset", "ackley2d", "--torch-threads", threads,
              "--out", str(tmp_path / "s"), "--no-progress"])
    assert exit_.value.code == 2
    assert "--torch-threads: expected a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.unit
def test_a_data_file_without_rows_exits_2_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.npz"
    np.savez(empty, X=np.zeros((0, 3)), y=np.zeros(0))
    code = main(["build", "--data", str(empty), "--out", str(tmp_path / "s"), "--no-progress"])
    assert code == 2
    assert "holds no rows" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run `momlp build ... --out tmp/s`: exit 2, one line on stderr, no store; that line."""
    out = tmp_path / "s"
    try:
        code = main(["build", *argv, "--out", str(out), "--no-progress"])
    except SystemExit as exit_:  # argparse's own refusals
        code = int(exit_.code or 0)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(("momlp build", "usage"))
    assert not out.exists()
    return err


def _npz(tmp_path: Path, name: str = "d.npz", rows: int = 40, **arrays: Any) -> str:
    rng = np.random.default_rng(0)
    values = {"X": rng.normal(size=(rows, 2)), "y": rng.normal(size=rows), **arrays}
    path = tmp_path / name
    np.savez(path, **values)
    return str(path)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", "cannot read the archive"),  # numpy raised EOFError
        (b"PK\x03\x04 truncated", "cannot read the archive"),  # zipfile.BadZipFile
        ("npy", "not an .npz archive"),  # one .npy array under an .npz name
    ],
)
def test_an_unreadable_archive_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | str, words: str
) -> None:
    bad = tmp_path / "bad.npz"
    if content == "npy":
        with bad.open("wb") as handle:
            np.save(handle, np.zeros((30, 3)))
    else:
        bad.write_bytes(content)
    assert words in _refused(tmp_path, capsys, "--data", str(bad))


@pytest.mark.unit
def test_archive_members_that_are_not_npy_arrays_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import zipfile

    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("X", b"not an array")
        archive.writestr("y", b"nor this")
    assert "not .npy arrays" in _refused(tmp_path, capsys, "--data", str(bad))


@pytest.mark.unit
@pytest.mark.parametrize(("array", "scale"), [("X", 1e300), ("y", 1e39)])
def test_values_beyond_float32_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], array: str, scale: float
) -> None:
    rng = np.random.default_rng(1)
    data = {"X": rng.normal(size=(40, 2)), "y": rng.normal(size=40)}
    data[array] = data[array] * scale  # finite in float64, infinite once cast to float32
    err = _refused(tmp_path, capsys, "--data", _npz(tmp_path, **data))
    assert "values beyond float32" in err


@pytest.mark.unit
def test_a_target_of_no_columns_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(tmp_path, capsys, "--data", _npz(tmp_path, y=np.zeros((40, 0))))
    assert "at least one column" in err


@pytest.mark.unit
def test_a_blank_label_in_a_table_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pandas")
    table = tmp_path / "t.csv"
    rows = [f"{i * 0.1},{i * 0.2},{'ab'[i % 2]}" for i in range(30)]
    rows[7] = "0.7,1.4,"
    table.write_text("a,b,label\n" + "\n".join(rows) + "\n")
    err = _refused(tmp_path, capsys, "--data", str(table), "--target", "label")
    assert "'label' has 1 empty cells (first: row 7)" in err


@pytest.mark.unit
def test_a_held_out_split_too_small_to_fit_the_temperature_is_refused_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(tmp_path, capsys, "--data", _npz(tmp_path), "--experts", "4",
                   "--test-fraction", "0.03", "--executor", "local")
    assert "1 held-out row is too few" in err and "--temperature" in err


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--seed", "-1"], "--seed: expected an integer >= 0"),
        (["--num-cpus", "0"], "--num-cpus: expected a positive integer"),
        (["--baseline-epochs", "-1"], "--baseline-epochs: must not be negative"),
        (["--noise-std", "inf"], "--noise-std: must be a finite number >= 0"),
        (["--noise-std", "nan"], "--noise-std: must be a finite number >= 0"),
    ],
)
def test_out_of_range_options_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str,
) -> None:
    assert words in _refused(tmp_path, capsys, "--dataset", "ackley2d", *argv)


@pytest.mark.unit
def test_an_empty_out_is_refused_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["build", "--dataset", "ackley2d", "--out", "", "--no-progress"])
    assert exit_.value.code == 2
    assert "--out: an empty path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_a_ray_address_with_nothing_listening_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_training: None
) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = main(["build", "--dataset", "ackley2d", "--ray-address", f"127.0.0.1:{port}",
                 "--out", str(tmp_path / "s"), "--no-progress"])
    assert code == 1
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.unit
def test_an_integer_target_read_as_many_classes_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from trainer import load_data_file

    rng = np.random.default_rng(2)
    path = _npz(tmp_path, rows=200, y=rng.integers(100, 400, size=200))
    with caplog.at_level("WARNING"):
        data = load_data_file(Path(path))
    assert data.task == "classification"
    assert any("pass --task regression" in r.getMessage() for r in caplog.records)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # Each was silently ignored: the store was built, but not as asked.
        (["--kind", "graph", "--dataset", "tree8", "--gate", "learned-linear"],
         "--gate does not apply to --kind graph"),
        (["--kind", "graph", "--dataset", "tree8", "--balanced-tree", "--temperature", "0.5"],
         "--temperature, --balanced-tree do not apply to --kind graph"),
        (["--kind", "pmoe", "--dataset", "digits-patches", "--select-epoch", "best-validation"],
         "--select-epoch does not apply to --kind pmoe"),
        (["--kind", "hyper", "--dataset", "hyper-synthetic", "--executor", "ray"],
         "--executor does not apply to --kind hyper"),
        (["--kind", "hyper", "--dataset", "hyper-synthetic", "--expert-activation", "gelu"],
         "--expert-activation does not apply to --kind hyper"),
        (["--dataset", "ackley2d", "--named-conditions", "4"],
         "--named-conditions does not apply to --kind momlp"),
        (["--dataset", "ackley2d", "--condition-source", "prototype"],
         "--condition-source does not apply to --kind momlp"),
        (["--kind", "hyper", "--condition-source", "prototype", "--dataset", "ackley2d",
          "--num-cpus", "2"], "--num-cpus does not apply to --condition-source prototype"),
    ],
)
def test_an_option_the_kind_would_ignore_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    err = _refused(tmp_path, capsys, *argv)
    assert err == f"momlp build: {words}"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # Each kind reads the option from one data source and ignored it from the other.
        (["--dataset", "ackley2d", "--target", "t"],
         "--target names a column of a .csv/.parquet --data table; it does not apply to "
         "--dataset ackley2d"),
        (["--data", "{npz}", "--target", "t"],
         "--target names a column of a .csv/.parquet --data table; it does not apply to "
         "an .npz file (its y is the target)"),
        (["--kind", "hyper", "--condition-source", "prototype", "--dataset", "ackley2d",
          "--target", "t"],
         "--target names a column of a .csv/.parquet --data table; it does not apply to "
         "--dataset ackley2d"),
        (["--kind", "graph", "--data", "{npz}", "--samples", "100"],
         "--samples sizes a built-in --dataset and does not apply to --data"),
        (["--kind", "pmoe", "--data", "{npz}", "{npz}", "--num-train", "9", "--num-test", "9"],
         "--num-train, --num-test size a built-in --dataset and do not apply to --data"),
    ],
)
def test_an_option_the_data_source_would_leave_unread_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    npz = _npz(tmp_path, y=np.arange(40.0))
    err = _refused(tmp_path, capsys, *(npz if a == "{npz}" else a for a in argv))
    assert err == f"momlp build: {words}"


@pytest.mark.unit
def test_a_build_replaced_before_its_summary_prints_no_other_builds_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The summary was read back from the store: another build's figures (or, after a
    # publish without a report, a KeyError traceback and exit 1 from a build that published).
    import trainer
    from experts_store import ExpertArch, ExpertMLP, Manifest, StoreWriter

    def publish(out: Path, report: dict[str, Any]) -> Manifest:
        with StoreWriter(out) as writer:
            writer.add_expert(0, ExpertMLP(ExpertArch(widths=(2, 4, 1))))
            writer.router_path.write_bytes(b"router")
            writer.write_report(report)
            return writer.publish(task="regression", input_dim=2, output_dim=1,
                                  routing="tree", branching=2)

    def build_store(config: Any, **_: Any) -> Manifest:
        mine = publish(Path(config.out), {"mixture": {"metric": "mse", "value": 0.5},
                                          "baseline": None, "timings": {"total_s": 3.0}})
        publish(Path(config.out), {"other": "build"})  # a build into the same --out
        return mine

    monkeypatch.setattr(trainer, "build_store", build_store)
    assert _build_into(str(tmp_path / "store")) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert (summary["mixture"], summary["baseline"], summary["total_s"]) == (None, None, None)
    assert "another publish has replaced it since" in captured.err
    assert "Traceback" not in captured.err
    # Not replaced: its own figures.
    monkeypatch.setattr(trainer, "build_store", lambda config, **_: publish(
        Path(config.out), {"mixture": {"metric": "mse", "value": 0.25}, "baseline": None,
                           "timings": {"total_s": 2.0}}))
    assert _build_into(str(tmp_path / "store")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["mixture"]["value"], summary["total_s"]) == (0.25, 2.0)


@pytest.mark.integration
def test_sigterm_stops_a_build_as_ctrl_c_does_leaving_no_staging_folder(tmp_path: Path) -> None:
    # SIGTERM (a CI job's cancel, `kill`, a pod's stop) ended the process where it stood:
    # exit 143 with the staging folder left in the store for an hour.
    import os
    import signal
    import time

    out = tmp_path / "store"
    build = subprocess.Popen(
        [sys.executable, "-m", "server._cli", "build", "--dataset", "ackley2d", "--experts",
         "4", "--branching", "2", "--quick", "--epochs", "100000", "--executor", "local",
         "--no-baseline", "--no-progress", "--torch-threads", "1", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob(".staging-*/experts")) and time.monotonic() < deadline:
            assert build.poll() is None, build.communicate()[1]
            time.sleep(0.1)
        assert list(out.glob(".staging-*")), "the build never staged anything"
        build.send_signal(signal.SIGTERM)
        _, err = build.communicate(timeout=60)
    finally:
        if build.poll() is None:
            build.kill()
            build.communicate()
    assert build.returncode == 143, err
    assert not list(out.glob(".staging-*")), err
    assert "Traceback" not in err


@pytest.mark.unit
def test_a_build_that_cannot_write_its_store_says_so_in_one_line_and_leaves_it_as_it_was(
    tmp_path: Path,
) -> None:
    # A file size limit stands in for a full disk: the experts (3.6 KB) fit under it, the
    # report (~5 KB) does not. It was a 30-line traceback ending in "OSError: [Errno 27]",
    # with the new version's experts and router left in the store, named by no manifest.
    import os
    import resource

    out = tmp_path / "store"
    command = [
        sys.executable, "-m", "server._cli", "build", "--dataset", "ackley2d", "--executor",
        "local", "--experts", "4", "--branching", "2", "--grid-size", "12", "--width", "16",
        "--epochs", "2", "--prototype-epochs", "1", "--no-progress", "--torch-threads", "1",
        "--out", str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, capture_output=True, check=True, env=env, timeout=300)
    live = json.loads((out / "manifest.json").read_text())["store_version"]
    files = sorted(p.relative_to(out) for p in out.rglob("*"))

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    failed = subprocess.run(
        [*command, "--seed", "7"], capture_output=True, text=True, env=env, timeout=300,
        preexec_fn=limit_file_size,
    )
    assert failed.returncode == 1, failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"momlp build: cannot write {out.absolute()}/.staging-"), last
    assert last.endswith(
        f"/report.json: File too large; nothing was published (version {live} is still live)"
    ), last
    assert "Traceback" not in failed.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == files
    assert main(["store", "verify", str(out)]) == 0
