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
