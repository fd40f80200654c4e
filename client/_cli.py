"""`momlp loadtest`: registration imports only the standard library; the handler imports the rest.

This keeps `momlp --help` fast, and the command works where neither torch nor ray is installed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "loadtest",
        help="load-test a running momlp server and write a report",
        description=(
            "Send POST /v1/predict with return_stats=true at a controlled expert law and report "
            "latency, throughput, cache hits and device memory per request."
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


def run(args: argparse.Namespace) -> int:
    from ._exceptions import MomlpError
    from ._loadtest import LoadTestConfig, run_loadtest

    try:
        config = LoadTestConfig(
            url=args.url,
            requests=args.requests if args.duration is not None or args.requests else 1000,
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
        )
    except ValueError as exc:
        print(f"momlp loadtest: {exc}", file=sys.stderr)
        return 2
    try:
        report = run_loadtest(config, progress=None if args.quiet else sys.stderr)
    except MomlpError as exc:
        print(f"momlp loadtest: {exc}", file=sys.stderr)
        return 1
    print(report.summary())
    if args.report is not None:
        print(f"report: {args.report / 'report.html'}")
        print(f"figures: {args.report / 'report.json'}")
        print(f"requests: {args.report / 'requests.csv'}")
        for name in report.plots:
            print(f"plot: {args.report / name}")
    return 0 if report.ok > 0 else 1
