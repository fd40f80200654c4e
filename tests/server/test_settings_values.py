"""Bad values an operator types for `momlp serve`: each is refused at start, in one line that
names the option or variable as typed, with exit code 2 and no traceback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import server._runner
from server._cli import build_parser, main
from server._serve_cli import CliError, parse_bytes, settings_from_args

pytestmark = pytest.mark.unit

_HUGE = "9" * 400


def _error_lines(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> str:
    return capsys.readouterr().err + caplog.text


def test_a_byte_size_of_hundreds_of_digits_is_refused_by_name_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # It raised OverflowError out of argparse: a traceback.
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--store", str(tmp_path), "--cache-bytes", _HUGE])
    assert stopped.value.code == 2
    out = _error_lines(capsys, caplog)
    assert "--cache-bytes" in out and "above 8 EiB" in out


def test_the_same_size_in_the_environment_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MOMLP_HOST_CACHE_BYTES", _HUGE + "TiB")
    assert main(["serve", "--store", str(tmp_path)]) == 2
    assert "MOMLP_HOST_CACHE_BYTES" in caplog.text and "above 8 EiB" in caplog.text


def test_a_byte_size_is_read_exactly() -> None:
    # Through float, 2**53 + 1 bytes became 2**53.
    assert parse_bytes(str(2**53 + 1)) == 2**53 + 1
    assert parse_bytes("2.000000000000000001GiB") == 2 * 2**30
    assert parse_bytes("9223372036854775807") == 2**63 - 1
    with pytest.raises(argparse.ArgumentTypeError, match="above 8 EiB"):
        parse_bytes("9223372036854775808")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MOMLP_HOST", ""),  # bound every interface
        ("MOMLP_HOST", "  "),
        ("MOMLP_STORE", ""),  # served the working directory
        ("MOMLP_MODEL_NAME", ""),
        ("MOMLP_ACTOR_RESOURCE", ""),  # asked Ray for a resource no node has
    ],
)
def test_a_blank_variable_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(CliError, match=f"{variable}: '{value}' is blank"):
        settings_from_args(build_parser().parse_args(["serve"]))


def test_a_blank_host_option_is_refused_naming_it() -> None:
    with pytest.raises(CliError, match="--host: '' is blank"):
        settings_from_args(build_parser().parse_args(["serve", "--host", ""]))


def test_a_blank_store_option_is_refused_not_read_as_the_working_directory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["serve", "--store", ""])
    assert stopped.value.code == 2
    assert "--store: '' is blank" in capsys.readouterr().err


def test_a_model_name_no_v2_url_can_reach_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # /v2/models/{name}/infer takes one path segment: every /v2 request got 404.
    monkeypatch.setenv("MOMLP_MODEL_NAME", "team/model")
    with pytest.raises(CliError, match="MOMLP_MODEL_NAME: 'team/model' contains '/'"):
        settings_from_args(build_parser().parse_args(["serve"]))


def test_help_gives_the_units_and_defaults_of_sizes_and_times(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert "cache budget per actor, bytes (e.g. 512MiB, 2GB; default 256MiB)" in flat
    assert "request body limit, bytes (e.g. 64MiB; default 32MiB; 413 above)" in flat
    assert "--max-batch-wait-ms MS batch window, ms (default 2)" in flat


def test_a_host_that_does_not_resolve_is_refused_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    started: list[object] = []
    monkeypatch.setattr(server._runner, "run_server", lambda settings: started.append(settings))
    (tmp_path / "manifest.json").write_text("{}")
    # --port 0 skipped the bind check: Ray and the actors started, then uvicorn failed.
    code = main(["serve", "--store", str(tmp_path), "--port", "0", "--host", "no-such.invalid"])
    assert code == 2 and started == []
    assert "--host / MOMLP_HOST 'no-such.invalid'" in caplog.text


@pytest.mark.parametrize(
    ("argv", "variable", "named"),
    [
        (["--max-body-bytes", "1"], None, "--max-body-bytes"),
        (["--max-body-bytes", "64"], None, "--max-body-bytes"),  # 64MiB, its unit left off
        ([], "1023", "MOMLP_MAX_BODY_BYTES"),
        ([], "0", "MOMLP_MAX_BODY_BYTES"),
    ],
)
def test_a_body_limit_no_request_fits_under_is_refused_at_start_naming_it(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    argv: list[str],
    variable: str | None,
    named: str,
) -> None:
    # MOMLP_MAX_BODY_BYTES=1 started a server that answered every request with 413.
    started: list[object] = []
    monkeypatch.setattr(server._runner, "run_server", lambda settings: started.append(settings))
    if variable is not None:
        monkeypatch.setenv("MOMLP_MAX_BODY_BYTES", variable)
    (tmp_path / "manifest.json").write_text("{}")
    assert main(["serve", "--store", str(tmp_path), *argv]) == 2
    assert started == []
    assert f"{named}: " in caplog.text and "below the least body limit, 1024 (1 KiB)" in caplog.text


def test_the_least_body_limit_is_accepted() -> None:
    args = build_parser().parse_args(["serve", "--max-body-bytes", "1KiB"])
    assert settings_from_args(args).max_body_bytes == 1024


@pytest.mark.parametrize(
    "variable", ["MOMLP_MAX_ROWS", "MOMLP_MAX_BATCH_ROWS", "MOMLP_MAX_QUEUE_ROWS",
                 "MOMLP_CACHE_BYTES", "MOMLP_MAX_CONNECTIONS", "MOMLP_ACTORS"],
)
def test_a_count_or_size_of_zero_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "0")
    with pytest.raises(CliError, match=f"{variable}: Input should be greater than or equal to 1"):
        settings_from_args(build_parser().parse_args(["serve"]))
