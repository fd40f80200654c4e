"""`momlp loadtest` arguments and handler (the handler runs against the fake server)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import AsyncClient, LoadTestConfig, _cli, _loadtest, _runner

pytestmark = pytest.mark.unit


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="momlp")
    _cli.register(root.add_subparsers(dest="command"))
    return root


def test_defaults_and_exclusive_options(capsys):
    args = parser().parse_args(["loadtest"])
    assert (args.url, args.requests, args.duration, args.concurrency, args.rate) == (
        "http://127.0.0.1:8000",
        None,
        None,
        8,
        None,
    )
    assert args.handler is _cli.run
    for argv in (
        ["loadtest", "--requests", "5", "--duration", "3"],
        ["loadtest", "--concurrency", "2", "--rate", "10"],
    ):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
    capsys.readouterr()


def test_bad_distribution_exits_2(capsys):
    args = parser().parse_args(["loadtest", "--distribution", "pareto"])
    assert args.handler(args) == 2
    assert "distribution" in capsys.readouterr().err


def test_handler_runs_and_writes_the_report(make_server, tmp_path, monkeypatch, capsys):
    server = make_server(clock=None)
    monkeypatch.setattr(
        _loadtest,
        "default_client_factory",
        lambda config: AsyncClient(transport=httpx.MockTransport(server.handler)),
    )
    freezes: list[None] = []
    monkeypatch.setattr(_runner, "_freeze_alive", lambda: freezes.append(None))
    args = parser().parse_args(
        [
            "loadtest",
            "--requests",
            "12",
            "--concurrency",
            "3",
            "--batch",
            "2",
            "--distribution",
            "zipf:1.1",
            "--report",
            str(tmp_path),
            "--no-plots",
            "--quiet",
        ]
    )
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "requests 12 (ok 12, errors 0)" in out and "report.json" in out
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["rows"] == 24 == server.predict_rows
    assert data["config"]["distribution"] == "zipf:1.1"
    # The CLI's process is the load test's: what is alive left the cyclic GC before the
    # first request (its records would, each FREEZE_EVERY).
    assert freezes == [None]


def test_unreachable_server_exits_1(monkeypatch, capsys):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(
        _loadtest,
        "default_client_factory",
        lambda config: AsyncClient(transport=httpx.MockTransport(refuse), max_retries=0),
    )
    args = parser().parse_args(["loadtest", "--requests", "3", "--quiet"])
    assert args.handler(args) == 1
    assert "refused" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["a file", "under a file"])
def test_a_report_path_that_cannot_be_a_directory_exits_2_before_any_request(
    make_server, tmp_path, monkeypatch, capsys, case
):
    server = make_server(clock=None)
    monkeypatch.setattr(
        _loadtest,
        "default_client_factory",
        lambda config: AsyncClient(transport=httpx.MockTransport(server.handler)),
    )
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    report = taken if case == "a file" else taken / "report"
    args = parser().parse_args(
        ["loadtest", "--requests", "5", "--report", str(report), "--quiet"]
    )
    assert args.handler(args) == 2
    assert f"--report {report}" in capsys.readouterr().err
    assert server.predict_rows == 0  # nothing sent for a report that could not be written


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [("--retries", "-1", "--retries must be >= 0"), ("--timeout", "0", "--timeout must be > 0"),
     ("--timeout", "-1", "--timeout must be > 0")],
)
def test_bad_retries_and_timeouts_exit_2(capsys, flag, value, words):
    args = parser().parse_args(["loadtest", flag, value, "--quiet"])
    assert args.handler(args) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--requests", "0"], "--requests must be >= 1"),
        (["--batch", "0"], "--batch must be >= 1"),
        (["--top-k", "0"], "--top-k must be >= 1"),
        (["--concurrency", "0"], "--concurrency must be >= 1"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--duration", "0"], "--duration must be > 0"),
        (["--conditions", "0"], "--conditions must be in [1, 1000000]"),
        (["--conditions", "1000001"], "--conditions must be in [1, 1000000]"),
        (["--conditions", "4", "--condition-distribution", "cluster"],
         "--condition-distribution must be uniform or zipf:S"),
        (["--condition-distribution", "pareto"],
         "--condition-distribution must be uniform or zipf:S (S >= 0), got 'pareto'"),
        (["--gate", '{"tau": 1}'], "--gate: unknown gate fields ['tau']"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_and_exit_2_before_any_request(
    monkeypatch, capsys, argv, line
):
    from server._cli import main

    def no_client(config):
        pytest.fail("a client was made for a load test whose settings were refused")

    monkeypatch.setattr(_loadtest, "default_client_factory", no_client)
    assert main(["loadtest", *argv, "--quiet"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"momlp loadtest: {line}") and "\n" not in err, err
    assert "Traceback" not in err and captured.out == ""


def _answer_with(server: Any) -> Callable[[LoadTestConfig], AsyncClient]:
    """The CLI's load test sent to the fake `server` (through httpx.MockTransport)."""
    return lambda config: AsyncClient(transport=httpx.MockTransport(server.handler))


@pytest.mark.parametrize(
    ("limit", "status"), [(None, 0), ("1", 0), ("0.25", 0), ("0.2", 3), ("0", 3)]
)
@pytest.mark.parametrize("loop", [["--concurrency", "3"], ["--rate", "500"]])
def test_max_failed_fraction_fails_the_run_with_exit_3_and_says_why(
    make_server: Callable[..., Any], make_error: Callable[..., httpx.Response], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], limit: str | None,
    status: int, loop: list[str],
) -> None:
    server = make_server(clock=None)
    # Every fourth request refused (as rows of the wrong width are): 3 of 12 fail.
    server.fail_every = (4, make_error(422, "invalid_input", "wrong dimension"))
    monkeypatch.setattr(_loadtest, "default_client_factory", _answer_with(server))
    argv = ["loadtest", "--requests", "12", *loop, "--report", str(tmp_path), "--no-plots",
            "--quiet"]
    if limit is not None:
        argv += ["--max-failed-fraction", limit]
    args = parser().parse_args(argv)
    assert args.handler(args) == status
    err = capsys.readouterr().err
    data = json.loads((tmp_path / "report.json").read_text())
    assert (data["requests"], data["errors"], data["errors_by_status"]) == (12, 3, {"422": 3})
    if limit is None:
        assert data["failure_check"] is None and err == ""
        return
    assert data["failure_check"] == {
        "failed_fraction": 0.25, "max_failed_fraction": float(limit), "passed": status == 0,
    }
    if status == 0:
        assert err == ""
    else:
        assert err == (
            "momlp loadtest: 0.25 of the requests failed (3 of 12), more than "
            f"--max-failed-fraction {limit} allows\n"
        )
    html = (tmp_path / "report.html").read_text()
    assert 'data-key="failure_check/failed_fraction"' in html
    assert ("passed" if status == 0 else "failed") + " (at most" in html


def test_max_failed_fraction_judges_each_gate_run_alone(
    make_server: Callable[..., Any], make_error: Callable[..., httpx.Response], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    server = make_server(clock=None)
    refused = {"count": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        # The second gate's run: every other request refused; the first gate's: none.
        if request.url.path == "/v1/predict" and json.loads(request.content).get("gate") == {
            "top_p": 0.5
        }:
            refused["count"] += 1
            if refused["count"] % 2 == 0:
                return make_error(422, "invalid_input", "gate refused")
        answer: httpx.Response = server.handler(request)
        return answer

    monkeypatch.setattr(
        _loadtest, "default_client_factory",
        lambda config: AsyncClient(transport=httpx.MockTransport(handler)),
    )
    args = parser().parse_args(
        ["loadtest", "--requests", "8", "--concurrency", "2", "--gate", '{"temperature": 1.0}',
         "--gate", '{"top_p": 0.5}', "--max-failed-fraction", "0.1", "--report", str(tmp_path),
         "--no-plots", "--quiet"]
    )
    assert args.handler(args) == 3
    err = capsys.readouterr().err
    assert err == (
        'momlp loadtest: gate-2 {"top_p": 0.5}: 0.5 of the requests failed (4 of 8), more than '
        "--max-failed-fraction 0.1 allows\n"
    )
    first = json.loads((tmp_path / "gate-1" / "report.json").read_text())
    second = json.loads((tmp_path / "gate-2" / "report.json").read_text())
    assert first["failure_check"] == {
        "failed_fraction": 0.0, "max_failed_fraction": 0.1, "passed": True,
    }
    assert second["failure_check"]["passed"] is False and second["errors"] == 4


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "inf"])
def test_a_max_failed_fraction_outside_0_1_exits_2_before_any_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    from server._cli import main

    def no_client(config: LoadTestConfig) -> AsyncClient:
        pytest.fail("a client was made for a load test whose settings were refused")

    monkeypatch.setattr(_loadtest, "default_client_factory", no_client)
    assert main(["loadtest", "--max-failed-fraction", value, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"momlp loadtest: --max-failed-fraction must be a number in [0, 1], got {float(value)!r}\n"
    )
