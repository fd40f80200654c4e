"""The server process's memory over many hot swaps and actor kills: does it level off?

A long-running server republished every few minutes, whose actors die now and then, must not
grow without end. A real app over a real Ray pool (2 actors filling a 2-CPU embedded Ray, room
for 20 of 200 experts each) serves a few 4-row requests after each event:
- swaps: a writer in another process (as `momlp build` would be) republishes the store with 20
  of its experts changed, and the app swaps it in (`POST /v1/admin/reload`);
- kills: one actor's process is SIGKILLed, and the app waits until both actors answer again
  (Ray's restarts, then a replacement once they are spent).

Printed, one JSON line every `--every` events: the process's RSS and the objects the cyclic
collector tracks (what `gc.freeze` at start already holds is not counted); then, per phase,
the RSS growth per event over its first half, its second half and its last fifth, which
should fall to about nothing where the growth is bounded tables filling up; and last, RSS
before and after `malloc_trim(0)` (how much of it is freed memory the C allocator kept).
Linux only (process names from `ps`, `/proc`). Ray prints a notice of each killed worker on
the same stdout: the records are the lines that start with `{`.

    python benchmarks/server_memory.py [--quick] [--swaps N] [--kills N]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import multiprocessing
import os
import platform
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import numpy as np
import torch
from hot_swap import ARCH, K, N, publish

from server import Settings, create_app
from server.pool import ray_session

CHANGED_PER_SWAP = 20
REQUESTS_PER_EVENT = 20


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def where_and_when() -> dict[str, object]:
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def actor_pids() -> list[int]:
    """The actor processes of this script's own Ray (its raylet is our child), never those of
    another server on the machine."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    parent, actors = {}, []
    for line in out.splitlines()[1:]:
        pid, ppid, *args = line.split(maxsplit=2)
        parent[int(pid)] = int(ppid)
        if args and "ray::ExpertActor" in args[0]:
            actors.append(int(pid))

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parent.get(pid, 0)
        return False

    return sorted(pid for pid in actors if ours(pid))


def writer(conn: Connection, root: str, prototypes: np.ndarray) -> None:
    """Publish whatever seeds arrive, in this process: a writer's own growth (with the files
    it retired in the last ten minutes; `writer_memory.py`) is not the server's."""
    torch.set_num_threads(1)
    while (seeds := conn.recv()) is not None:
        publish(Path(root), torch.from_numpy(prototypes), seeds)
        conn.send(True)


def sample(phase: str, event: int) -> dict[str, object]:
    gc.collect()
    return {
        "bench": "server_memory.sample",
        "phase": phase,
        "event": event,
        "rss_mb": round(rss_mb(), 2),
        "gc_objects": len(gc.get_objects()),
        "t": round(time.monotonic(), 1),
    }


def summary(phase: str, samples: list[dict[str, object]]) -> dict[str, object]:
    """RSS growth per event over the phase's first half, second half and last fifth."""
    first, middle, last = samples[0], samples[len(samples) // 2], samples[-1]
    tail = samples[-1 - max(1, len(samples) // 5)]

    def per_event_kb(a: dict[str, object], b: dict[str, object]) -> float:
        events = int(str(b["event"])) - int(str(a["event"]))
        grown = float(str(b["rss_mb"])) - float(str(a["rss_mb"]))
        return round(1024 * grown / max(events, 1), 1)

    return {
        "bench": "server_memory.summary",
        "phase": phase,
        "events": last["event"],
        "rss_mb_first": first["rss_mb"],
        "rss_mb_last": last["rss_mb"],
        "kb_per_event_first_half": per_event_kb(first, middle),
        "kb_per_event_second_half": per_event_kb(middle, last),
        "kb_per_event_last_fifth": per_event_kb(tail, last),
        "gc_objects_first": first["gc_objects"],
        "gc_objects_last": last["gc_objects"],
    }


async def run_phase(
    phase: str, events: int, every: int, step: Callable[[int], Awaitable[None]]
) -> dict[str, object]:
    samples = []
    for event in range(events + 1):
        if event % every == 0 or event == events:
            samples.append(sample(phase, event))
            print(json.dumps(samples[-1]), flush=True)
        if event < events:
            await step(event)
    return summary(phase, samples)


async def main_async(args: argparse.Namespace, workdir: Path) -> list[dict[str, object]]:
    rng = np.random.default_rng(0)
    prototypes = torch.randn(K, N, generator=torch.Generator().manual_seed(0)).numpy()
    seeds = list(range(1, K + 1))
    root = workdir / "store"
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=writer, args=(theirs, str(root), prototypes), daemon=True
    )
    process.start()
    summaries = []
    try:
        ours.send(seeds)
        ours.recv()
        settings = Settings(
            store=root, actors=2, cache_bytes=20 * ARCH.nbytes(), watch_store=False,
            # An actor out of Ray's restarts is replaced within a second, not a minute: the
            # kills phase measures memory, not the pause that keeps a crash loop from spinning.
            actor_replace_interval_s=1.0,
        )
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://bench", timeout=120
            ) as client:

                async def load(requests: int) -> None:
                    for _ in range(requests):
                        rows = prototypes[rng.integers(0, K, 4)] + 0.01
                        response = await client.post("/v1/predict", json={"inputs": rows.tolist()})
                        response.raise_for_status()

                async def swap(_: int) -> None:
                    for expert_id in rng.choice(K, CHANGED_PER_SWAP, replace=False):
                        seeds[int(expert_id)] += 10_000
                    ours.send(seeds)
                    ours.recv()
                    reload = await client.post("/v1/admin/reload")
                    if not reload.json().get("reloaded"):
                        raise RuntimeError(f"the swap did not happen: {reload.text}")
                    await load(REQUESTS_PER_EVENT)

                async def kill(event: int) -> None:
                    pids = actor_pids()
                    os.kill(pids[event % len(pids)], signal.SIGKILL)
                    deadline = time.monotonic() + 120
                    while time.monotonic() < deadline:
                        actors = (await client.get("/v1/experts")).json()["actors"]
                        if all(actor["alive"] for actor in actors) and len(actor_pids()) == 2:
                            break
                        await asyncio.sleep(0.1)
                    else:
                        raise RuntimeError("the actors were not both back within 120 s")
                    await load(REQUESTS_PER_EVENT)

                await load(200)
                if args.swaps:
                    summaries.append(await run_phase("swaps", args.swaps, args.every, swap))
                if args.kills:
                    summaries.append(
                        await run_phase("kills", args.kills, max(1, args.every // 5), kill)
                    )
                before = rss_mb()
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                summaries.append({
                    "bench": "server_memory.trim",
                    "rss_mb_before_trim": round(before, 2),
                    "rss_mb_after_trim": round(rss_mb(), 2),
                })
    finally:
        ours.send(None)
        process.join(timeout=30)
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="150 swaps and 12 kills")
    parser.add_argument("--swaps", type=int, default=None, help="hot swaps (default 600)")
    parser.add_argument("--kills", type=int, default=None, help="actor kills (default 40)")
    parser.add_argument("--every", type=int, default=25, help="swaps between samples")
    args = parser.parse_args()
    if args.swaps is None:
        args.swaps = 150 if args.quick else 600
    if args.kills is None:
        args.kills = 12 if args.quick else 40
    torch.set_num_threads(1)
    with ray_session(num_cpus=2), tempfile.TemporaryDirectory() as tmp:
        summaries = asyncio.run(main_async(args, Path(tmp)))
    for record in summaries:
        print(json.dumps({**record, **where_and_when()}), flush=True)


if __name__ == "__main__":
    main()
