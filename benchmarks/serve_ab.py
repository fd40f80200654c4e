"""A/B of one `momlp serve` setting, or of two commits, on `vs_ray_serve.py`'s workload.

Starts a fresh `momlp serve` per trial with the environment variable `--setting` set to each
of `--values` in turn (the order reversed every other trial, so drift on a shared machine
falls on both sides), drives it with the same closed-loop client as `vs_ray_serve.py`, and
prints one JSON line per trial: rows/s, latency, serving and client CPU per row.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_ab.py \\
        --setting MOMLP_PREFETCH --values true,false --trials 3 \\
        --store /tmp/momlp-vs-issue --experts 200 --widths 16,256,512,8 \\
        --experts-per-actor 20 --rows-per-request 4

`--code BASE,NEW` (two git commits) compares code instead: each side's server and actors run
from a temporary git worktree of its commit (the server started in it, with it on
PYTHONPATH: Ray puts the server's working directory first on its actors' sys.path), with this
checkout's virtual environment; the worktrees are removed afterwards.

Only momlp runs: a setting's effect is a comparison of momlp with itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vs_ray_serve import KEPT, MACHINE, add_workload_args, prepare, run_momlp, summarize

REPO = Path(__file__).resolve().parent.parent

@contextmanager
def code_trees(commits: list[str], repo: Path = REPO) -> Iterator[dict[str, Path]]:
    """A detached git worktree of each commit, in a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="momlp-ab-code-") as folder:
        trees: dict[str, Path] = {}
        try:
            for index, commit in enumerate(commits):
                tree = Path(folder) / f"{index}"
                made = subprocess.run(
                    ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), commit],
                    capture_output=True, text=True,
                )  # fmt: skip
                if made.returncode != 0:
                    raise SystemExit(f"no worktree of {commit!r}: {made.stderr.strip()}")
                trees[commit] = tree
            yield trees
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                    check=False, capture_output=True,
                )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", help="a variable such as MOMLP_PREFETCH")
    parser.add_argument("--values", help="comma-separated values to compare")
    parser.add_argument("--code", help="two comma-separated git commits to compare instead")
    parser.add_argument("--trials", type=int, default=3)
    add_workload_args(parser)
    parser.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    args = parser.parse_args(argv)
    if args.code is not None:
        if args.setting is not None or args.values is not None:
            parser.error("give --code, or --setting with --values, not both")
        values = args.code.split(",")
        if len(values) != 2 or values[0] == values[1]:
            parser.error("--code takes two different commits, BASE,NEW")
    elif args.setting is None or args.values is None:
        parser.error("give --setting with --values, or --code")
    elif not args.setting.startswith("MOMLP_"):
        parser.error("--setting must be a MOMLP_ environment variable")
    else:
        values = args.values.split(",")
    with code_trees(values if args.code is not None else []) as trees:
        store, _widths, _expert_bytes, work = prepare(args)
        for trial in range(args.trials):
            for value in values if trial % 2 == 0 else values[::-1]:
                _trial(args, store, work, trial, value, trees.get(value))
    return 0


def _trial(args: argparse.Namespace, store: Any, work: list[Any], trial: int, value: str,
           code: Path | None) -> None:
    if code is None:
        os.environ[args.setting] = value  # inherited by the `momlp serve` subprocess
    records, seconds, cpu = run_momlp(args, store, work, trial, code=code)
    line = summarize(
        "momlp", records, args.warmup, seconds, trial,
        rows_per_request=args.rows_per_request, cpu=cpu,
    )  # fmt: skip
    print(json.dumps({
        "benchmark": "serve_ab", "setting": args.setting or "code", "value": value,
        "trial": trial, **{key: line[key] for key in KEPT},
        "store": str(store.root), "rows_per_request": args.rows_per_request,
        "requests": args.requests, "concurrency": args.concurrency,
        "client": args.client, "machine": MACHINE,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
