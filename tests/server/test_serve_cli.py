"""`momlp serve` / `momlp demo` option handling (the serving itself is in tests/integration)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from app_support import build_small_store

import server._runner
import server._serve_cli
import server.pool
import trainer
from server._cli import build_parser, main
from server._serve_cli import CliError, parse_bytes, ray_address_problem, settings_from_args

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [("268435456", 268435456), ("256MiB", 256 * 2**20), ("1.5GB", 1_500_000_000), ("4k", 4000)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-1"])
def test_parse_bytes_refuses_nonsense(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_options_become_settings_and_the_environment_fills_the_rest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MOMLP_MAX_ROWS", "77")
    monkeypatch.setenv("MOMLP_ACTORS", "5")
    args = _args(
        "--store",
        str(tmp_path),
        "--port",
        "0",
        "--actors",
        "2",
        "--cache-bytes",
        "1MiB",
        "--device",
        "cpu",
        "--cache-policy",
        "lru",
        "--host-cache-bytes",
        "2GiB",
        "--ray-address",
        "10.0.0.1:6379",
        "--no-watch-store",
        "--watch-interval-s",
        "0.5",
    )
    settings = settings_from_args(args)
    assert settings.store == tmp_path and settings.port == 0
    assert settings.actors == 2  # the option wins over MOMLP_ACTORS
    assert settings.max_rows == 77  # not given: the environment applies
    assert settings.cache_bytes == 2**20 and settings.device == "cpu"
    assert settings.cache_policy == "lru" and settings.host_cache_bytes == 2 * 2**30
    defaults = settings_from_args(_args("--store", str(tmp_path)))
    assert defaults.cache_policy == "tinylfu" and defaults.host_cache_bytes == 0
    assert settings.ray_address == "10.0.0.1:6379" and settings.watch_store is False
    assert settings.watch_interval_s == 0.5
    assert settings.host == "127.0.0.1" and settings.api_key is None


def test_a_misspelt_setting_in_the_environment_is_named_with_its_likely_meaning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # MOMLP_ACTOR=3 served one actor without a word.
    monkeypatch.setenv("MOMLP_ACTOR", "3")
    monkeypatch.setenv("MOMLP_CACHE_BYTE", "1GiB")
    monkeypatch.setenv("MOMLP_CLUSTER_DIR", "/tmp/x")  # deploy/local-cluster.sh's own
    with caplog.at_level("WARNING", logger="server._serve_cli"):
        settings = settings_from_args(_args("--store", str(tmp_path)))
    assert settings.actors == 1
    messages = [r.getMessage() for r in caplog.records]
    assert "MOMLP_ACTOR is not a momlp setting and is ignored; did you mean MOMLP_ACTORS?" in (
        messages
    )
    assert ("MOMLP_CACHE_BYTE is not a momlp setting and is ignored; did you mean "
            "MOMLP_CACHE_BYTES?") in messages
    assert not any("CLUSTER_DIR" in m for m in messages)


def test_byte_sizes_in_the_environment_take_units_as_the_options_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # README: MOMLP_CACHE_BYTES takes "512MiB" and "2GB"; it was refused as not an integer.
    monkeypatch.setenv("MOMLP_CACHE_BYTES", "256MiB")
    monkeypatch.setenv("MOMLP_MAX_BODY_BYTES", "2GB")
    monkeypatch.setenv("MOMLP_HOST_CACHE_BYTES", "1073741824")
    settings = settings_from_args(_args("--store", str(tmp_path)))
    assert settings.cache_bytes == 256 * 2**20 and settings.max_body_bytes == 2 * 10**9
    assert settings.host_cache_bytes == 2**30
    monkeypatch.setenv("MOMLP_CACHE_BYTES", "12 parsecs")
    with pytest.raises(CliError, match="not a byte size"):
        settings_from_args(_args("--store", str(tmp_path)))


def test_every_option_the_readme_table_names_exists() -> None:
    # The configuration table's second column: `momlp serve` options (the README once named
    # --watch-interval-s, which did not exist).
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    named = set(re.findall(r"^\| `MOMLP_[A-Z0-9_]+` \| `(--[a-z0-9-]+)", readme, re.MULTILINE))
    serve = next(
        action.choices["serve"] for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    options = {flag for action in serve._actions for flag in action.option_strings}
    assert "--watch-interval-s" in named and "--cache-bytes" in named
    assert named - options == set()


def test_api_key_comes_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SERVICE_KEY", "k-123")
    settings = settings_from_args(_args("--api-key-env", "MY_SERVICE_KEY"))
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "k-123"
    assert "k-123" not in repr(settings)
    monkeypatch.delenv("MY_SERVICE_KEY")
    with pytest.raises(CliError, match="MY_SERVICE_KEY"):
        settings_from_args(_args("--api-key-env", "MY_SERVICE_KEY"))


def test_invalid_values_are_reported_without_a_traceback(tmp_path: Path) -> None:
    with pytest.raises(CliError, match="port"):
        settings_from_args(_args("--store", str(tmp_path), "--port", "70000"))
    assert main(["serve", "--store", str(tmp_path), "--actors", "0"]) == 2


def test_a_bad_value_is_named_as_it_was_given_and_infinity_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "watch_interval_s" named neither the option nor the variable; inf passed "> 0", and the
    # store watcher never polled.
    with pytest.raises(CliError, match="--watch-interval-s: Input should be a finite number"):
        settings_from_args(_args("--store", str(tmp_path), "--watch-interval-s", "inf"))
    monkeypatch.setenv("MOMLP_REQUEST_TIMEOUT_S", "nan")
    with pytest.raises(CliError, match="MOMLP_REQUEST_TIMEOUT_S: Input should be a finite"):
        settings_from_args(_args("--store", str(tmp_path)))


def test_serve_refuses_a_directory_without_a_store(tmp_path: Path) -> None:
    assert main(["serve", "--store", str(tmp_path / "nothing")]) == 2


def _record_runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    runs: list[Any] = []

    def fake_run(settings: Any) -> int:
        runs.append(settings)
        return 0

    monkeypatch.setattr(server._runner, "run_server", fake_run)
    # The demo shares one Ray between build and serve; these tests build and serve nothing real.
    monkeypatch.setattr(server.pool, "ray_session", lambda **kwargs: contextlib.nullcontext(False))
    return runs


def test_serve_runs_the_server_with_the_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs = _record_runs(monkeypatch)
    store = build_small_store(tmp_path / "store")
    assert main(["serve", "--store", str(store), "--port", "0"]) == 0
    assert [(s.store, s.port) for s in runs] == [(store, 0)]


def test_demo_builds_the_store_once_then_serves_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs = _record_runs(monkeypatch)
    builds: list[Any] = []

    def fake_build(config: Any, **kwargs: Any) -> None:
        builds.append(config)
        build_small_store(Path(config.out))

    monkeypatch.setattr(trainer, "build_store", fake_build)
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--port", "0"]) == 0
    assert main(["demo", "--port", "0"]) == 0
    assert len(builds) == 1
    config = builds[0]
    assert (config.dataset, config.experts, config.out) == ("ackley2d", 16, Path("demo-store"))
    assert [Path(s.store) for s in runs] == [Path("demo-store")] * 2
    assert main(["demo", "--port", "0", "--rebuild"]) == 0
    assert len(builds) == 2


def test_demo_takes_its_store_from_momlp_store_as_serve_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs = _record_runs(monkeypatch)
    monkeypatch.setattr(trainer, "build_store", lambda config, **kw: build_small_store(config.out))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOMLP_STORE", str(tmp_path / "mine"))
    assert main(["demo", "--port", "0"]) == 0
    assert [Path(s.store) for s in runs] == [tmp_path / "mine"]
    assert (tmp_path / "mine" / "manifest.json").is_file()
    assert not (tmp_path / "demo-store").exists()


def test_sigterm_during_the_demo_build_stops_it_as_ctrl_c_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Ray's own SIGTERM handler (put in by ray.init) aborted the build with a crash dump.
    import signal

    runs = _record_runs(monkeypatch)

    def build_then_sigterm(config: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(trainer, "build_store", build_then_sigterm)
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["demo", "--port", "0"]) == 130
    assert runs == []  # nothing served
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_ray_address_nobody_answers_at_or_that_is_no_address_fails_before_ray(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # ray.init waited ~14 minutes for a head that is not there, and gave malformed addresses
    # a traceback.
    import socket

    runs = _record_runs(monkeypatch)
    store = build_small_store(tmp_path / "s")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    assert main(["serve", "--store", str(store), "--ray-address", f"127.0.0.1:{free}",
                 "--ray-connect-wait-s", "0"]) == 1
    assert f"no Ray cluster answers at 127.0.0.1:{free}" in caplog.text
    for bad in ("nonsense", "127.0.0.2", "127.0.0.2:notaport", "http://127.0.0.2:6390"):
        # Refused at once, whatever the wait (the default 30 s would show as a slow test).
        assert main(["serve", "--store", str(store), "--ray-address", bad]) == 2, bad
    with socket.socket() as head:  # something listening: serve goes on to Ray
        head.bind(("127.0.0.1", 0))
        head.listen()
        port = head.getsockname()[1]
        assert main(["serve", "--store", str(store), "--ray-address", f"127.0.0.1:{port}"]) == 0
    assert [s.ray_address for s in runs] == [f"127.0.0.1:{port}"]


class _FakeTime:
    """A clock that only `sleep` moves; `on_sleep(n)` runs after the n-th sleep."""

    def __init__(self, on_sleep: Any = None) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self._on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        if self._on_sleep is not None:
            self._on_sleep(len(self.slept))


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_ray_head_that_starts_after_the_server_is_waited_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Under a supervisor or on Kubernetes the head often listens seconds after the server
    # starts: "connection refused" at once was exit 1.
    import socket

    port = _free_port()
    head = socket.socket()

    def start_head(sleeps: int) -> None:
        if sleeps == 3:  # the head listens after the third try failed
            head.bind(("127.0.0.1", port))
            head.listen()

    time = _FakeTime(start_head)
    with head:
        answer = ray_address_problem(
            f"127.0.0.1:{port}", wait_s=30.0, clock=time.clock, sleep=time.sleep
        )
    assert answer == (0, "")
    assert len(time.slept) == 3 and time.now < 30.0
    waits = [r.getMessage() for r in caplog.records if "waiting up to 30 s" in r.getMessage()]
    assert len(waits) == 1 and f"no Ray cluster answers at 127.0.0.1:{port} yet" in waits[0]


def test_a_ray_head_that_never_starts_is_given_up_on_after_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = _free_port()
    time = _FakeTime()
    code, why = ray_address_problem(
        f"127.0.0.1:{port}", wait_s=3.0, clock=time.clock, sleep=time.sleep
    )
    assert code == 1
    assert why.startswith(f"no Ray cluster answers at 127.0.0.1:{port} (") and "after 3 s" in why
    assert time.now == pytest.approx(3.0) and len(time.slept) > 1
    assert sum("waiting up to" in r.getMessage() for r in caplog.records) == 1  # logged once


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.2", "127.0.0.2:0", "http://h:6379"])
def test_a_malformed_ray_address_fails_at_once_whatever_the_wait(address: str) -> None:
    def no_sleep(seconds: float) -> None:
        raise AssertionError("a malformed address was waited for")

    code, _ = ray_address_problem(address, wait_s=30.0, clock=lambda: 0.0, sleep=no_sleep)
    assert code == 2


@pytest.mark.parametrize(
    ("argv", "variable", "expected"),
    [([], None, 30.0), (["--ray-connect-wait-s", "5"], None, 5.0), ([], "7.5", 7.5)],
)
def test_serve_waits_for_the_ray_head_as_long_as_it_is_told(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    variable: str | None,
    expected: float,
) -> None:
    asked: list[tuple[str, float]] = []

    def problem(address: str, *, wait_s: float) -> tuple[int, str]:
        asked.append((address, wait_s))
        return 1, "no head"

    monkeypatch.setattr(server._serve_cli, "ray_address_problem", problem)
    if variable is not None:
        monkeypatch.setenv("MOMLP_RAY_CONNECT_WAIT_S", variable)
    argv = ["serve", "--store", str(tmp_path), "--ray-address", "127.0.0.1:6379", *argv]
    assert main(argv) == 1
    assert asked == [("127.0.0.1:6379", expected)]


def test_registering_the_commands_imports_neither_torch_nor_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys, argparse, server._serve_cli as m; "
        "m.register(argparse.ArgumentParser().add_subparsers()); "
        "print(sorted(n for n in ('torch', 'ray', 'fastapi') if n in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_momlp_help_lists_every_command_without_importing_torch_numpy_or_ray() -> None:
    code = (
        "import sys; from server._cli import build_parser; "
        "text = build_parser().format_help(); "
        "print(sorted({'torch', 'numpy', 'ray'} & set(sys.modules))); "
        "print(all(c in text for c in ('build', 'serve', 'store', 'loadtest', 'demo')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "True"]


def test_a_store_the_server_cannot_serve_is_one_line_at_startup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real uvicorn start whose lifespan refuses the store: the reason in one line, exit 1."""
    from app_support import app_settings, fake_pool

    from server.http import create_app

    monkeypatch.setattr(server.pool, "ray_session", lambda **kwargs: contextlib.nullcontext(False))
    store = build_small_store(tmp_path / "store")
    settings = app_settings(store, cache_bytes=64, port=0)
    with caplog.at_level("INFO"):
        code = server._runner.run_server(
            settings, app_factory=lambda s: create_app(s, pool_factory=fake_pool)
        )
    assert code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    reason = next(m for m in errors if m.startswith(f"cannot serve {store}: "))
    assert "expert 0 needs" in reason and "more than the cache budget of 64 bytes" in reason
    assert reason.endswith("(each actor's budget: --cache-bytes, MOMLP_CACHE_BYTES)")
    assert "\n" not in reason
    assert not any("Traceback" in m for m in errors), errors


def test_an_unexpected_startup_error_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from app_support import app_settings

    from server.http import create_app

    def broken_pool(settings: Any) -> Any:
        raise ZeroDivisionError("a defect, not a user's mistake")

    monkeypatch.setattr(server.pool, "ray_session", lambda **kwargs: contextlib.nullcontext(False))
    settings = app_settings(build_small_store(tmp_path / "store"), port=0)
    with caplog.at_level("INFO"):
        code = server._runner.run_server(
            settings, app_factory=lambda s: create_app(s, pool_factory=broken_pool)
        )
    assert code == 1
    errors = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert "Traceback" in errors and "ZeroDivisionError" in errors


@pytest.mark.parametrize(
    ("host", "api_key", "warned"),
    [("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
     ("127.0.0.2", None, False), ("0.0.0.0", None, True), ("10.1.2.3", None, True),
     ("0.0.0.0", "sekrit", False)],
)
def test_a_server_open_beyond_this_machine_without_a_key_is_warned_about(
    host: str, api_key: str | None, warned: bool
) -> None:
    from app_support import app_settings

    settings = app_settings(Path("store"), host=host, api_key=api_key)
    assert server._runner.open_without_key(settings) is warned


def test_the_warning_is_logged_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The lifespan refuses the store (budget too small), so nothing is ever bound.
    from app_support import app_settings, fake_pool

    from server.http import create_app

    monkeypatch.setattr(server.pool, "ray_session", lambda **kwargs: contextlib.nullcontext(False))
    settings = app_settings(build_small_store(tmp_path / "store"), cache_bytes=64,
                            host="0.0.0.0", port=0)
    with caplog.at_level("INFO"):
        server._runner.run_server(
            settings, app_factory=lambda s: create_app(s, pool_factory=fake_pool)
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("0.0.0.0 with no API key" in w and "MOMLP_API_KEY" in w for w in warnings)


def test_the_root_command_says_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"momlp {version('momlp')}"


def test_an_unknown_log_level_is_refused_not_read_as_info(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "verbose", "serve", "--help"])
    assert exit_info.value.code == 2
    assert "--log-level: invalid choice: 'VERBOSE'" in capsys.readouterr().err
    assert build_parser().parse_args(["--log-level", "debug"]).log_level == "DEBUG"


@pytest.mark.parametrize("given", ["manifest", "elsewhere"])
def test_a_store_option_naming_a_file_says_it_takes_the_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, given: str
) -> None:
    store = build_small_store(tmp_path / "store")
    path = store / "manifest.json" if given == "manifest" else tmp_path / "rows.npz"
    path.touch()
    with caplog.at_level("ERROR"):
        assert main(["serve", "--store", str(path)]) == 2
    hint = f" (its parent, {store}?)" if given == "manifest" else ""
    assert f"--store {path} is a file; it takes the store's directory{hint}" in caplog.text


class _Terminal:
    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("terminal", [False, True])
def test_ray_lines_carry_colour_codes_only_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    # An actor's death put Ray's "(raylet)" lines into the server's log file wrapped in
    # terminal colour codes.
    from io import StringIO

    from ray._private.worker import print_worker_logs

    monkeypatch.setenv("RAY_COLOR_PREFIX", "unset by the test")
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    if terminal:
        monkeypatch.setattr(sys, "stdout", _Terminal())
        monkeypatch.setattr(sys, "stderr", _Terminal())
    assert main([]) == 2  # no command: help, after the logging is set up
    log = StringIO()
    line = {"pid": "raylet", "ip": "127.0.0.1", "localhost": "127.0.0.1",
            "lines": ["A worker died or was killed while executing a task"]}
    print_worker_logs(line, log)
    assert ("\x1b[" in log.getvalue()) is terminal
    assert "(raylet) A worker died or was killed" in re.sub(r"\x1b\[[0-9;]*m", "", log.getvalue())
