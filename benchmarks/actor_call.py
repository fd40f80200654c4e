"""What one pool call to an expert actor costs in CPU, beside the work it carries.

The serving side of `vs_ray_serve.py` spends more CPU per row than its work (the in-process
limit); this splits off one part of the difference. The same `ExpertActor.run` payload (G
groups of R one-expert rows, every expert resident) is run

- in this process on an `ActorCore` (the work alone: lease, aligned padded forward, reply);
- through a Ray actor that answers a reply computed beforehand (the call alone), at once
  or after sleeping as long as the work takes (a busy actor, without the CPU);
- through a real Ray actor (`ExpertActor`, 1 CPU, 1 torch thread, as the pool starts them),
  awaited from asyncio with 1 or 4 calls in flight, for max_concurrency 1 and 4 (the pool
  uses 4),
- through the same actor's channel (`MOMLP_ACTOR_CHANNEL=socket`, the pool's default: a Unix
  socket into the actor, `server.pool.Channel`), 1 or 4 calls in flight,

and prints the CPU time per call of the actor process and of the caller (this process),
from the processes' own counters. Ray's overhead per call is the actor's CPU minus the work,
plus the caller's CPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/actor_call.py [--quick]

Prints one JSON line per configuration. Uses (or builds) a store of random-weight experts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from vs_ray_serve import open_or_build

MACHINE = os.environ.get("MOMLP_BENCH_MACHINE", "2-core x86-64 VM, no GPU")


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def payload_for(store: Any, groups: int, rows: int, seed: int) -> list[tuple[Any, np.ndarray]]:
    rng = np.random.default_rng(seed)
    width = store.manifest.input_dim
    return [
        (store.expert_ref(g % store.manifest.num_experts),
         rng.standard_normal((rows, width)).astype(np.float32))
        for g in range(groups)
    ]


def in_process(payload: list[tuple[Any, np.ndarray]], calls: int) -> tuple[float, Any]:
    """CPU ms per `ActorCore.run` of `payload` in this process, and the reply it gives."""
    from server.pool._actor import ActorCore

    core = ActorCore(name="bench", budget_bytes=1 << 34)
    for _ in range(max(20, calls // 20)):
        reply = core.run(payload)
    me = psutil.Process()
    start = cpu_s(me)
    for _ in range(calls):
        core.run(payload)
    core.close()
    return (cpu_s(me) - start) * 1000.0 / calls, reply


async def drive(
    handle: Any, payload: Any, calls: int, inflight: int, socket_path: Path | None = None
) -> None:
    """`calls` run calls, `inflight` at a time: Ray calls, or over the actor's channel."""
    from server.pool import Channel

    channel = None if socket_path is None else await Channel.connect(socket_path)

    async def caller(count: int) -> None:
        for _ in range(count):
            if channel is None:
                await handle.run.remote(payload)
            else:
                await channel.run(payload)

    try:
        await asyncio.gather(*(caller(calls // inflight) for _ in range(inflight)))
    finally:
        if channel is not None:
            await channel.close()


class Echo:
    """An actor that takes the same payload and answers a reply computed beforehand: what
    the call itself costs, with no work and no cache. With `wait_s` it sleeps that long
    first (no CPU), as a call carrying real work keeps the actor busy."""

    def __init__(self, reply: Any, wait_s: float = 0.0) -> None:
        self._reply = reply
        self._wait_s = wait_s

    def get_pid(self) -> int:
        return os.getpid()

    def run(self, payload: Any) -> Any:
        if self._wait_s:
            time.sleep(self._wait_s)
        return self._reply


def through_ray(
    payload: Any,
    calls: int,
    concurrency: int,
    inflight: int,
    echo: Any = None,
    wait_s: float = 0.0,
    channel: bool = False,
) -> dict[str, float]:
    import ray

    from server.pool._actor import ExpertActor

    options = ray.remote(ExpertActor if echo is None else Echo).options(
        num_cpus=1, max_concurrency=concurrency
    )
    handle: Any = (
        options.remote("bench", "cpu", 1 << 34, 1)
        if echo is None
        else options.remote(echo, wait_s)
    )
    actor = psutil.Process(ray.get(handle.get_pid.remote()))
    me = psutil.Process()
    folder = Path(tempfile.mkdtemp(prefix="momlp-channels-")) if channel else None
    path = None
    if folder is not None:
        opened = ray.get(handle.open_channel.remote(str(folder)))
        path = Path(opened[1])
    try:
        asyncio.run(drive(handle, payload, max(inflight, calls // 5), inflight, path))  # warm
        actor_start, own_start, wall_start = cpu_s(actor), cpu_s(me), time.perf_counter()
        asyncio.run(drive(handle, payload, calls, inflight, path))
        wall = time.perf_counter() - wall_start
        done = calls // inflight * inflight
        return {
            "actor_cpu_ms_per_call": (cpu_s(actor) - actor_start) * 1000.0 / done,
            "caller_cpu_ms_per_call": (cpu_s(me) - own_start) * 1000.0 / done,
            "calls_per_s": done / wall,
        }
    finally:
        ray.kill(handle)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and shapes")
    parser.add_argument("--calls", type=int, default=None, help="calls per configuration")
    parser.add_argument("--store", type=Path, default=None, help="store to use or build")
    parser.add_argument("--widths", default="32,512,512,8")
    args = parser.parse_args(argv)
    calls = args.calls or (400 if args.quick else 3000)
    shapes = [(2, 2)] if args.quick else [(1, 1), (2, 2), (8, 4)]
    widths = tuple(int(w) for w in args.widths.split(","))
    torch.set_num_threads(1)
    root = args.store or Path(tempfile.mkdtemp(prefix="momlp-actor-call-")) / "store"
    store = open_or_build(root, experts=16, widths=widths, seed=0)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for groups, rows in shapes:
            payload = payload_for(store, groups, rows, seed=groups)
            work, reply = in_process(payload, calls)
            base = {
                "bench": "actor_call", "groups": groups, "rows_per_group": rows,
                "widths": list(widths), "calls": calls, "machine": MACHINE,
                "python": platform.python_version(), "ray": ray.__version__,
            }
            print(json.dumps({**base, "where": "in_process", "cpu_ms_per_call": work}),
                  flush=True)
            for inflight, wait_ms in ((4, 0.0), (1, work), (4, work)):
                print(json.dumps({
                    **base, "where": "ray_echo", "max_concurrency": 1, "inflight": inflight,
                    "wait_ms": wait_ms,
                    **through_ray(payload, calls, 1, inflight, echo=reply,
                                  wait_s=wait_ms / 1000.0),
                }), flush=True)
            for concurrency in (1, 4):
                for inflight in (1, 4):
                    figures = through_ray(payload, calls, concurrency, inflight)
                    overhead = (figures["actor_cpu_ms_per_call"] - work
                                + figures["caller_cpu_ms_per_call"])
                    print(json.dumps({
                        **base, "where": "ray", "max_concurrency": concurrency,
                        "inflight": inflight, **figures,
                        "work_cpu_ms_per_call": work,
                        "ray_overhead_cpu_ms_per_call": overhead,
                    }), flush=True)
            for inflight in (1, 4):
                figures = through_ray(payload, calls, 4, inflight, channel=True)
                overhead = (figures["actor_cpu_ms_per_call"] - work
                            + figures["caller_cpu_ms_per_call"])
                print(json.dumps({
                    **base, "where": "channel", "max_concurrency": 4, "inflight": inflight,
                    **figures, "work_cpu_ms_per_call": work,
                    "call_overhead_cpu_ms_per_call": overhead,
                }), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
