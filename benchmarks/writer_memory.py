"""A process that publishes many versions: does its memory level off?

A trainer may republish a store from one long-lived process. Each publish here writes the
store's 200 experts (`hot_swap.py`'s, 0.28 MB each) with `--changed` of them given new weights,
through `StoreWriter`, in this process. The files no manifest references any more are retired:
listed in the store's `retired.json` and deleted `--retire-after-s` later (the writer's default,
600 s, unless given). Until then each publish finds, lists and rewrites more of them, and the
process's memory grows with their number; past that time it should level off.

Printed, one JSON line every `--every` publishes: RSS, RSS after `malloc_trim(0)` (the freed
memory the C allocator kept handed back), the objects the cyclic collector tracks, the files
`retired.json` lists and the seconds since the start; then the growth per publish of the
trimmed RSS over the first half, the second half and the last fifth (from the second sample:
the first publish writes every file). Linux only (`/proc`, glibc).

    python benchmarks/writer_memory.py [--quick] [--publishes N] [--retire-after-s S]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from hot_swap import K, N, publish
from server_memory import CHANGED_PER_SWAP, rss_mb, summary, where_and_when


def retired_files(root: Path) -> int:
    try:
        return len(json.loads((root / "retired.json").read_text(encoding="utf-8"))["retired"])
    except FileNotFoundError:
        return 0


def run(args: argparse.Namespace, root: Path) -> list[dict[str, object]]:
    libc = ctypes.CDLL("libc.so.6")
    prototypes = torch.randn(K, N, generator=torch.Generator().manual_seed(0))
    seeds = list(range(K))
    started = time.monotonic()
    samples: list[dict[str, object]] = []
    for version in range(args.publishes + 1):
        for i in range(args.changed):
            seeds[(version * args.changed + i) % K] += K  # a seed no expert has had
        publish(root, prototypes, seeds, retire_after_s=args.retire_after_s)
        if version % args.every == 0 or version == args.publishes:
            before = rss_mb()
            libc.malloc_trim(0)
            samples.append({
                "bench": "writer_memory.sample",
                "event": version,
                "rss_mb_untrimmed": round(before, 2),
                "rss_mb": round(rss_mb(), 2),
                "retired_files": retired_files(root),
                "gc_objects": len(gc.get_objects()),
                "s": round(time.monotonic() - started, 1),
            })
            print(json.dumps(samples[-1]), flush=True)
    return [{**summary("publishes", samples[1:]), "bench": "writer_memory.summary"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="150 publishes, retired after 30 s")
    parser.add_argument("--publishes", type=int, default=None, help="default 400")
    parser.add_argument(
        "--changed", type=int, default=CHANGED_PER_SWAP,
        help="experts changed a publish (as server_memory.py's writer)",
    )
    parser.add_argument(
        "--retire-after-s", type=float, default=None,
        help="how long a file no manifest references is kept (default: the writer's, 600 s)",
    )
    parser.add_argument("--every", type=int, default=25, help="publishes between samples")
    args = parser.parse_args()
    if args.publishes is None:
        args.publishes = 150 if args.quick else 400
    if args.quick and args.retire_after_s is None:
        args.retire_after_s = 30.0
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        records = run(args, Path(tmp))
    for record in records:
        settings = {"retire_after_s": args.retire_after_s, "changed": args.changed}
        print(json.dumps({**record, **settings, **where_and_when()}), flush=True)


if __name__ == "__main__":
    main()
