"""A/B of one `momlp serve` setting on `vs_ray_serve.py`'s store, load and driver.

Starts a fresh `momlp serve` per trial with the environment variable `--setting` set to each
of `--values` in turn (the order reversed every other trial, so drift on a shared machine
falls on both sides), drives it with the same closed-loop client as `vs_ray_serve.py`, and
prints one JSON line per trial: rows/s, latency, serving and client CPU per row.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_ab.py \\
        --setting MOMLP_PREFETCH --values true,false --trials 3 \\
        --store /tmp/momlp-vs-issue --experts 200 --widths 16,256,512,8 \\
        --experts-per-actor 20 --rows-per-request 4

Only momlp runs: a setting's effect is a comparison of momlp with itself.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import UTC, datetime

from vs_ray_serve import MACHINE, add_workload_args, prepare, run_momlp, summarize

KEPT = (
    "rows_per_s", "p50_ms", "p99_ms", "errors", "hit_rate",
    "cpu_ms_per_row_serving", "cpu_ms_per_row_client", "cpu_cores_busy",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", required=True, help="a variable such as MOMLP_PREFETCH")
    parser.add_argument("--values", required=True, help="comma-separated values to compare")
    parser.add_argument("--trials", type=int, default=3)
    add_workload_args(parser)
    parser.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    args = parser.parse_args(argv)
    if not args.setting.startswith("MOMLP_"):
        parser.error("--setting must be a MOMLP_ environment variable")
    values = args.values.split(",")
    store, _widths, _expert_bytes, work = prepare(args)
    for trial in range(args.trials):
        for value in values if trial % 2 == 0 else values[::-1]:
            os.environ[args.setting] = value  # inherited by the `momlp serve` subprocess
            records, seconds, cpu = run_momlp(args, store, work, trial)
            line = summarize(
                "momlp", records, args.warmup, seconds, trial,
                rows_per_request=args.rows_per_request, cpu=cpu,
            )  # fmt: skip
            print(json.dumps({
                "benchmark": "serve_ab", "setting": args.setting, "value": value,
                "trial": trial, **{key: line[key] for key in KEPT},
                "store": str(store.root), "rows_per_request": args.rows_per_request,
                "requests": args.requests, "concurrency": args.concurrency,
                "client": args.client, "machine": MACHINE,
                "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
