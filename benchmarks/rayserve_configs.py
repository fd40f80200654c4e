"""Ray Serve's throughput knobs side by side, on `vs_ray_serve.py`'s workload and peer.

`vs_ray_serve.py` compares momlp with Ray Serve in its best documented configuration. Its
performance guide names, beside the throughput flags (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`,
always on here, and `RAY_SERVE_ENABLE_HA_PROXY=1`, on unless `--rayserve-proxy python`), two
things to try: raising `max_ongoing_requests` (default 5) for `async` callables, and dynamic
request batching (`@serve.batch`). This script runs the peer alone in each configuration of
`--configs`, the order rotated every round, each from a cold start, so the best one can be
chosen by measurement, not by assumption:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rayserve_configs.py \\
        --store /tmp/momlp-vs-issue --experts 200 --widths 16,256,512,8 \\
        --experts-per-actor 20 --rows-per-request 4 --requests 1500 --warmup 150 \\
        --configs default:0:0,16:0:0,16:8:1,16:16:2 --rounds 3

A configuration is `MAX_ONGOING:BATCH:WAIT_MS` (`default` keeps Ray Serve's own
max_ongoing_requests; BATCH 0 answers each request alone). Prints one JSON line per
configuration and round, then one per configuration with the medians over rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from vs_ray_serve import (
    KEPT,
    MACHINE,
    add_rayserve_proxy_arg,
    add_workload_args,
    cpu_facts,
    prepare,
    run_rayserve,
    summarize,
)


@dataclass(frozen=True)
class PeerConfig:
    """One configuration of the Ray Serve peer."""

    max_ongoing: int | None
    batch: int
    batch_wait_ms: float

    @property
    def label(self) -> str:
        ongoing = "default" if self.max_ongoing is None else str(self.max_ongoing)
        return f"{ongoing}:{self.batch}:{self.batch_wait_ms:g}"


def parse_config(text: str) -> PeerConfig:
    """`MAX_ONGOING:BATCH:WAIT_MS`, e.g. `default:0:0` or `16:8:1`."""
    try:
        ongoing, batch, wait = text.split(":")
        config = PeerConfig(
            None if ongoing == "default" else int(ongoing), int(batch), float(wait)
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not MAX_ONGOING:BATCH:WAIT_MS (e.g. default:0:0 or 16:8:1)"
        ) from None
    if config.batch < 0 or config.batch_wait_ms < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: BATCH and WAIT_MS must be >= 0")
    if config.max_ongoing is not None and config.max_ongoing < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: MAX_ONGOING must be >= 1 or default")
    return config


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument(
        "--configs",
        type=lambda text: [parse_config(part) for part in text.split(",")],
        default=[parse_config("default:0:0"), parse_config("16:0:0"), parse_config("16:8:1")],
        help="comma-separated MAX_ONGOING:BATCH:WAIT_MS configurations",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    add_rayserve_proxy_arg(parser)
    args = parser.parse_args(argv)
    args.rayserve_config = "best"
    store, _widths, _expert_bytes, work = prepare(args)
    configs: list[PeerConfig] = args.configs
    head = {
        "benchmark": "rayserve_configs",
        "store": str(args.store),
        "experts": store.manifest.num_experts,
        "rows_per_request": args.rows_per_request,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "proxy": args.rayserve_proxy,
        "machine": MACHINE,
        "cpu": cpu_facts(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    lines: dict[str, list[dict[str, Any]]] = {config.label: [] for config in configs}
    for round_ in range(args.rounds):
        # Rotated, so that each configuration runs first, last and between the others.
        shift = round_ % len(configs)
        for config in configs[shift:] + configs[:shift]:
            run_args = copy.copy(args)
            # 0: Ray Serve's own default (vs_ray_serve.peer_max_ongoing).
            run_args.rayserve_max_ongoing = config.max_ongoing or 0
            run_args.rayserve_batch = config.batch
            run_args.rayserve_batch_wait_ms = config.batch_wait_ms
            records, seconds, cpu = run_rayserve(run_args, store, work, round_)
            measured = summarize("ray_serve", records, args.warmup, seconds, round_,
                                 rows_per_request=args.rows_per_request, cpu=cpu)  # fmt: skip
            kept = {key: measured[key] for key in KEPT}
            lines[config.label].append(kept)
            print(json.dumps(head | {"config": config.label, "round": round_} | kept), flush=True)
    for label, rounds in lines.items():
        medians = {key: _median([r[key] for r in rounds]) for key in KEPT}
        print(json.dumps(head | {"config": label, "stat": "median"} | medians), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
