"""`momlp loadtest` arguments and handler (the handler runs against the fake server)."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from client import AsyncClient, _cli, _loadtest

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
