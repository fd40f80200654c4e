"""`momlp loadtest`: registration imports only the standard library; the handler imports the rest.

This keeps `momlp --help` fast, and the command works where neither torch nor ray is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._exceptions import LoadTestConfigError
    from ._loadtest_config import LoadTestConfig
    from ._report import LoadTestReport

__all__ = ["EXIT_TOO_MANY_FAILED", "register"]

# The exit status of a run in which more than --max-failed-fraction of the requests failed:
# apart from 1 (nothing answered, server unreachable, report unwritable) and 2 (bad flags), so
# that CI can tell "the server failed too often" from "the load test could not run".
EXIT_TOO_MANY_FAILED = 3


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "loadtest",
        help="load-test a running momlp server and write a report",
        description=(
            "Send POST /v1/predict with return_stats=true at a controlled expert law and report "
            "latency, throughput, cache hits and device memory per request."
        ),
        epilog=(
            "exit status: 0 done (also when some requests failed, unless "
            "--max-failed-fraction says otherwise), 1 no request answered (or the server "
            "unreachable, or the report unwritable), 2 bad flags, "
            f"{EXIT_TOO_MANY_FAILED} more than --max-failed-fraction of a run's requests failed"
        ),
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--requests", type=int, help="stop after N requests (default 1000)")
    stop.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=int, default=8, help="closed loop: requests in flight (default 8)"
    )
    load.add_argument(
        "--rate", type=float, metavar="R", help="open loop: Poisson arrivals at R requests/s"
    )
    parser.add_argument("--batch", type=int, default=1, help="rows per request (default 1)")
    parser.add_argument("--top-k", type=int, default=1, help="experts per row (default 1)")
    parser.add_argument("--mode", choices=("tree", "exact"), default=None, help="routing mode")
    parser.add_argument(
        "--distribution",
        default="uniform",
        help="expert law: uniform, zipf:S (e.g. zipf:1.1) or cluster (default uniform)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    parser.add_argument(
        "--conditions", type=int, metavar="N", default=None,
        help="kind hyper: draw each row's condition from N random conditions",
    )
    parser.add_argument(
        "--condition-distribution", default="uniform", metavar="LAW",
        help="kind hyper: law over the N conditions, uniform or zipf:S (default uniform)",
    )
    parser.add_argument(
        "--gate",
        metavar="JSON",
        action="append",
        default=None,
        help='gate object sent with every request, e.g. \'{"temperature": 0.01, '
        '"min_weight": 0.02}\' (fields: temperature, min_weight, top_p, beam, score); '
        "repeat it to run one load test per gate and compare them (gates.json, gates.png)",
    )
    parser.add_argument(
        "--eval",
        type=Path,
        metavar="FILE.npz",
        default=None,
        help="send the rows of FILE.npz (arrays x or X, and y) instead of the workload and "
        "report MSE (regression) or accuracy (classification) beside device memory per "
        "request; each row once unless --requests or --duration says otherwise",
    )
    parser.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="write report.html (plots inlined), report.json, requests.csv and the PNG plots",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="bearer key (default: the MOMLP_API_KEY environment variable)",
    )
    parser.add_argument(
        "--max-failed-fraction",
        type=float,
        metavar="F",
        default=None,
        help=f"exit {EXIT_TOO_MANY_FAILED} when more than F (0 to 1) of a run's requests failed, "
        "each --gate's run judged alone; 0 fails on the first failure (default: no limit)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument(
        "--retries", type=int, default=0, help="retries of 429/503/connect errors (default 0)"
    )
    parser.add_argument(
        "--binary", action="store_true", help="send inputs as application/x-npy (needs numpy)"
    )
    parser.add_argument(
        "--save-requests", action="store_true", help="keep one record per request in report.json"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no live progress line")
    parser.set_defaults(handler=run)


# LoadTestConfig's fields whose flag is not the field's name with dashes.
_FLAGS = {"duration_s": "--duration", "timeout_s": "--timeout", "max_retries": "--retries"}


def run(args: argparse.Namespace) -> int:
    from ._exceptions import LoadTestConfigError, MomlpError
    from ._loadtest_config import LoadTestConfig

    try:
        gates = [_parse_gate(text) for text in args.gate or [None]]
        requests = args.requests
        if requests is None and args.duration is None and args.eval is None:
            requests = 1000  # with --eval and neither, the load test sends one pass
        config = LoadTestConfig(
            url=args.url,
            requests=requests,
            duration_s=args.duration,
            concurrency=args.concurrency,
            rate=args.rate,
            batch=args.batch,
            top_k=args.top_k,
            mode=args.mode,
            distribution=args.distribution,
            seed=args.seed,
            report_dir=args.report,
            api_key=args.api_key if args.api_key is not None else os.environ.get("MOMLP_API_KEY"),
            timeout_s=args.timeout,
            max_retries=args.retries,
            binary=True if args.binary else None,
            save_requests=args.save_requests,
            plots=not args.no_plots,
            gate=gates[0],
            eval_data=args.eval,
            conditions=args.conditions,
            condition_distribution=args.condition_distribution,
            max_failed_fraction=args.max_failed_fraction,
        )
        if args.report is not None:
            _writable_directory(args.report)
        configs = [config] if len(gates) == 1 else [
            dataclasses.replace(
                config,
                gate=gate,
                report_dir=args.report / f"gate-{number}" if args.report is not None else None,
            )
            for number, gate in enumerate(gates, start=1)
        ]
    except LoadTestConfigError as exc:
        # The user typed flags, not the config's field names.
        print(f"momlp loadtest: {_as_flag(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"momlp loadtest: {exc}", file=sys.stderr)
        return 2
    try:
        reports = [_one(each, args) for each in configs]
    except MomlpError as exc:
        print(f"momlp loadtest: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the report directory went away or filled up during the run
        print(f"momlp loadtest: cannot write the report: {exc}", file=sys.stderr)
        return 1
    if len(configs) > 1:
        from ._compare import gate_rows, write_comparison

        scored = args.eval is not None
        metric = "metric, " if scored else ""
        print(f"\ngates compared ({metric}experts per row, vram/request p50 bytes):")
        for row in gate_rows(gates, reports):
            value = ""
            if scored:
                score = row["value"]
                value = "unscored, " if score is None else f"{row['metric']} {score:.6g}, "
            print(f"  {row['run']} {json.dumps(row['gate'])}: {value}"
                  f"{_number(row['experts_per_row'], '.3g')}, "
                  f"{_number(row['vram_bytes_p50'], '.0f')}")
        if args.report is not None:
            for path in write_comparison(gates, reports, args.report, plot=not args.no_plots):
                print(f"comparison: {path}")
    too_many_failed = False
    if args.max_failed_fraction is not None:
        for number, (gate, report) in enumerate(zip(gates, reports, strict=True), start=1):
            if report.failure_check is not None and not report.failure_check["passed"]:
                too_many_failed = True
                run_name = f"gate-{number} {json.dumps(gate)}: " if len(reports) > 1 else ""
                print(f"momlp loadtest: {run_name}{_failed_text(report)}", file=sys.stderr)
    if not all(report.ok > 0 for report in reports):
        return 1
    return EXIT_TOO_MANY_FAILED if too_many_failed else 0


def _failed_text(report: LoadTestReport) -> str:
    """One line: which fraction of the run's requests failed, against which limit."""
    assert report.failure_check is not None
    fraction = report.failure_check["failed_fraction"]
    limit = report.failure_check["max_failed_fraction"]
    if fraction is None:
        return f"no request was sent, which fails --max-failed-fraction {limit:g}"
    return (
        f"{fraction:.4g} of the requests failed ({report.errors} of {report.requests}), more "
        f"than --max-failed-fraction {limit:g} allows"
    )


def _number(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`; "-" when a run has none (e.g. no answered request)."""
    return "-" if value is None else format(value, spec)


def _one(config: LoadTestConfig, args: argparse.Namespace) -> LoadTestReport:
    from ._loadtest import run_loadtest
    from ._runner import FREEZE_EVERY

    if config.gate is not None and not args.quiet:
        print(f"gate {json.dumps(config.gate)}", file=sys.stderr)
    # This process is the load test's alone: its records may leave the cyclic GC.
    report = run_loadtest(
        config, progress=None if args.quiet else sys.stderr, freeze_every=FREEZE_EVERY
    )
    if config.gate is not None:
        print(f"gate {json.dumps(config.gate)}")
    print(report.summary())
    directory = config.report_dir
    if directory is not None:
        print(f"report: {directory / 'report.html'}")
        print(f"figures: {directory / 'report.json'}")
        print(f"requests: {directory / 'requests.csv'}")
        for name in report.plots:
            print(f"plot: {directory / name}")
    return report


def _writable_directory(path: Path) -> None:
    """`--report DIR` made (with its parents) and writable before any request is sent: a run
    is not thrown away at its end for a path that could never hold its report."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--report {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--report {path}: the directory is not writable")


def _as_flag(exc: LoadTestConfigError) -> str:
    """The error's message with the config field it names written as the flag the user typed."""
    flag = _FLAGS.get(exc.setting, "--" + exc.setting.replace("_", "-"))
    message = str(exc)
    if message.startswith(exc.setting):
        return flag + message[len(exc.setting):]
    return f"{flag}: {message}"


def _parse_gate(text: str | None) -> dict[str, Any] | None:
    """--gate's JSON object (ValueError, exit 2, for anything else)."""
    if text is None:
        return None
    try:
        gate = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--gate is not JSON: {exc}") from exc
    if not isinstance(gate, dict):
        raise ValueError(f"--gate must be a JSON object, got {text!r}")
    return gate
