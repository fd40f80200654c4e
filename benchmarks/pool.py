"""Serving-runtime figures: batching speed-up, cache policy vs Belady, miss latency vs raw load.

Prints one JSON line per measured configuration:

(a) `batching`: rows/s through Batcher + pool with per-expert batching (2 ms window) against
    one request per batch, at the same client concurrency; goal >= 3x.
(b) `hit_rate`: the pool's policy (the `cache_policy` setting, tinylfu by default, and LRU;
    also the rendezvous-partitioned pool of 2 and 4 actors of the same total capacity)
    against Belady's optimal on one Zipf(1.0) trace over 1,000 experts with room for 100;
    goal within 5 points. `hit_rate_other_traffic`: the same on shifting and bursty traffic.
(c) `miss_latency`: what a miss adds to a request (miss minus hit of the same request)
    against a raw `load_expert` of the same file, in-process (ActorCore) and through a Ray
    actor at two expert sizes; goal <= 1.2x. The end-to-end ratio is printed beside it.
(d) `cuda`: the pinned-buffer / side-stream load path; only where CUDA is present.

    .venv/bin/python benchmarks/pool.py            # full run, a few minutes
    .venv/bin/python benchmarks/pool.py --quick    # smaller, about a minute
    .venv/bin/python benchmarks/pool.py --only hit_rate,miss_latency --pool fake
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Beside this script: first on sys.path when it runs.
from _cache_sim import (  # noqa: E402
    belady_hits,
    bursty_trace,
    cache_hits,
    lfu_hits,
    lookahead_lru_hits,
    lru_reference_hits,
    partitioned_hits,
    shifting_trace,
    zipf_trace,
)

from experts_store import (  # noqa: E402
    ExpertArch,
    ExpertMLP,
    ExpertRef,
    Store,
    StoreWriter,
    load_expert,
)
from router import PrototypeTree  # noqa: E402
from server._settings import Settings  # noqa: E402
from server.batching import Batcher  # noqa: E402
from server.kinds import MomlpModel  # noqa: E402
from server.pool import (  # noqa: E402
    ActorCore,
    ExpertPool,
    FakeExpertPool,
    Group,
)

MACHINE = os.environ.get("MOMLP_BENCH_MACHINE", "2-core x86-64 VM, no GPU, shared with other work")


def emit(record: dict[str, Any]) -> None:
    record.setdefault("machine", MACHINE)
    record.setdefault("date", datetime.now(UTC).strftime("%Y-%m-%d"))
    record.setdefault("python", platform.python_version())
    print(json.dumps(record), flush=True)


def build_store(
    root: Path, *, K: int, n: int, width: int, hidden: int, out: int, seed: int = 0
) -> tuple[Path, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    arch = ExpertArch(widths=(n, *([width] * hidden), out))
    prototypes = torch.randn(K, n, generator=generator)
    with StoreWriter(root) as writer:
        for expert_id in range(K):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        PrototypeTree.build(prototypes, branching=4, seed=seed).save(writer.router_path)
        writer.publish(
            task="regression", input_dim=n, output_dim=out, routing="tree", branching=4
        )
    return root, prototypes


# ---------------------------------------------------------------- (a) batching


async def _drive(batcher: Batcher, xs: torch.Tensor, concurrency: int) -> float:
    """`concurrency` clients, each sending its share of 1-row requests one after another."""
    shares = [xs[i::concurrency] for i in range(concurrency)]

    async def client(rows: torch.Tensor) -> None:
        for i in range(rows.shape[0]):
            await batcher.submit(rows[i : i + 1])

    start = time.perf_counter()
    await asyncio.gather(*(client(s) for s in shares))
    return time.perf_counter() - start


async def _batching(
    pool: ExpertPool,
    tree: PrototypeTree,
    refs: list[ExpertRef],
    prototypes: torch.Tensor,
    args: argparse.Namespace,
    pool_kind: str,
) -> None:
    requests = 600 if args.quick else 3000
    concurrency = 32
    generator = torch.Generator().manual_seed(1)
    picks = torch.randint(0, prototypes.shape[0], (requests,), generator=generator)
    noise = torch.randn(requests, prototypes.shape[1], generator=generator)
    xs = prototypes[picks] + 0.05 * noise
    # Warm every expert so that both modes measure batching, not loading.
    await pool.run([Group(refs[e], prototypes[e : e + 1]) for e in range(prototypes.shape[0])])
    modes = {
        "batched": Settings(max_batch_wait_ms=2.0, max_batch_rows=4096, prefetch=False),
        "one_request_per_batch": Settings(
            max_batch_wait_ms=0.0, max_batch_rows=1, prefetch=False
        ),
    }
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    batches: dict[str, int] = {}
    for _ in range(1 if args.quick else 3):
        for mode, settings in modes.items():
            batcher = Batcher(MomlpModel(tree, refs), pool, settings)
            seconds = await _drive(batcher, xs, concurrency)
            batches[mode] = batcher.batches
            await batcher.close()
            rates[mode].append(requests / seconds)
    batched = statistics.median(rates["batched"])
    single = statistics.median(rates["one_request_per_batch"])
    emit({
        "bench": "pool.batching", "pool": pool_kind, "experts": int(prototypes.shape[0]),
        "requests": requests, "rows_per_request": 1, "concurrency": concurrency,
        "rows_per_s_batched": round(batched, 1),
        "rows_per_s_one_request_per_batch": round(single, 1),
        "speedup": round(batched / single, 2),
        "mean_batch_rows": round(requests / max(batches["batched"], 1), 1),
        "repeats": len(rates["batched"]), "goal": ">= 3x", "met": batched / single >= 3.0,
    })


# ---------------------------------------------------------------- (b) hit rate


def _hit_rate(args: argparse.Namespace) -> None:
    num_experts, capacity = 1000, 100
    length = 50_000 if args.quick else 300_000
    trace = zipf_trace(num_experts, length, 1.0, seed=0)
    lru = cache_hits(trace, capacity, "lru")
    assert lru == lru_reference_hits(trace, capacity), "ExpertCache is not LRU on this trace"
    pool_policy = Settings().cache_policy
    policy_hits = cache_hits(trace, capacity, pool_policy)
    optimal = belady_hits(trace, capacity)
    weights = 1.0 / np.arange(1, num_experts + 1)
    bound = float(weights[:capacity].sum() / weights.sum())
    record: dict[str, Any] = {
        "bench": "pool.hit_rate", "experts": num_experts, "capacity": capacity,
        "trace": f"zipf(1.0), {length} requests, seed 0", "belady": round(optimal / length, 4),
        "pool_policy": pool_policy, "pool": round(policy_hits / length, 4),
        "lru": round(lru / length, 4),
        # Requests are independent draws: no online policy beats keeping the top `capacity`.
        "online_bound_static_top": round(bound, 4),
        "pool_share_of_online_bound": round(policy_hits / length / bound, 3),
    }
    record["lfu_online_for_comparison"] = round(lfu_hits(trace, capacity) / length, 4)
    for window in (64, 256):
        record[f"lru_protecting_next_{window}_for_comparison"] = round(
            lookahead_lru_hits(trace, capacity, window) / length, 4
        )
    for actors in (2, 4):
        record[f"pool_{actors}_actors_rendezvous"] = round(
            partitioned_hits(trace, capacity, actors, pool_policy) / length, 4
        )
    gap = (optimal - policy_hits) / length * 100
    record.update({"gap_points": round(gap, 2), "goal": "pool within 5 points of Belady",
                   "met": gap <= 5.0})
    emit(record)
    # What the policy costs or gains where popularity moves or comes in bursts.
    others = {
        "shifting_every_20000": shifting_trace(num_experts, length, 20_000),
        "shifting_every_5000": shifting_trace(num_experts, length, 5_000),
        "bursty_sessions": bursty_trace(num_experts, length, seed=0),
    }
    for name, other in others.items():
        emit({
            "bench": "pool.hit_rate_other_traffic", "trace": name, "requests": len(other),
            "experts": num_experts, "capacity": capacity, "pool_policy": pool_policy,
            "pool": round(cache_hits(other, capacity, pool_policy) / len(other), 4),
            "lru": round(cache_hits(other, capacity, "lru") / len(other), 4),
            "belady": round(belady_hits(other, capacity) / len(other), 4),
        })


# ---------------------------------------------------------------- (c) miss latency


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000.0, 3)


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


async def _miss_latency(args: argparse.Namespace, workdir: Path, pool_kind: str) -> None:
    """Raw loads and misses of the same files, interleaved so machine noise hits both alike.

    The goal's figure is the miss penalty, (miss - hit) / raw load: what a miss costs a
    request over the same request hitting. The end-to-end ratio, miss / raw load, is
    printed too; it also charges the load for the forward pass and, through Ray, the
    actor round trip, which every request pays whether it hits or not.
    """
    width = 512 if args.quick else 1024
    experts = 4 if args.quick else 6
    rounds = 3 if args.quick else 5
    root, _ = build_store(workdir / "big", K=experts, n=64, width=width, hidden=4, out=8)
    store = Store.open(root)
    nbytes = store.expert_nbytes(0)
    row = torch.randn(1, 64)
    raw, miss, hit, cache_load = [], [], [], []
    for _ in range(rounds):
        # A fresh Store per round: every miss verifies the checksum, as the raw load does.
        core = ActorCore(name="bench", budget_bytes=nbytes)
        for e in range(experts):
            entry = store.expert_entry(e)
            path = root / entry.file
            raw.append(_timed(load_expert, path, expected_sha256=entry.sha256)[0])
            seconds, reply = _timed(core.run, [(store.expert_ref(e), row.numpy())])
            assert not reply.results[0].hit
            miss.append(seconds)
            cache_load.append(reply.results[0].load_ms / 1000.0)
            seconds, reply = _timed(core.run, [(store.expert_ref(e), row.numpy())])
            assert reply.results[0].hit
            hit.append(seconds)
        core.close()
    emit(_miss_record("in-process ActorCore", nbytes, raw, miss, hit, "verified in both",
                      cache_load_ms=_median_ms(cache_load)))
    if pool_kind != "ray":
        return
    sizes = [(root, experts)]
    if not args.quick:
        # A 4x larger expert: the round trip is fixed, the load grows with the bytes.
        big, _ = build_store(workdir / "bigger", K=4, n=64, width=2 * width, hidden=4, out=8)
        sizes.append((big, 4))
    for size_root, count in sizes:
        await _ray_miss_latency(size_root, count, rounds)


async def _ray_miss_latency(root: Path, experts: int, rounds: int) -> None:
    from server.pool import RayExpertPool

    store = Store.open(root)
    nbytes = store.expert_nbytes(0)
    row = torch.randn(1, 64)
    # Budget of one expert: a request for another expert always misses. The actor's Store
    # checks a file's checksum on its first read only, so after the first round the raw
    # reference is a plain load_expert.
    pool = RayExpertPool.create(Settings(actors=1, cache_bytes=nbytes))
    raw, miss, hit = [], [], []
    try:
        for r in range(rounds + 1):
            for e in range(experts):
                entry = store.expert_entry(e)
                raw_s = _timed(load_expert, root / entry.file)[0]
                t0 = time.perf_counter()
                [result] = await pool.run([Group(store.expert_ref(e), row)])
                miss_s = time.perf_counter() - t0
                assert not result.hit
                t0 = time.perf_counter()
                [again] = await pool.run([Group(store.expert_ref(e), row)])
                hit_s = time.perf_counter() - t0
                assert again.hit
                if r > 0:
                    raw.append(raw_s)
                    miss.append(miss_s)
                    hit.append(hit_s)
    finally:
        await pool.close()
    emit(_miss_record("Ray actor (pool.run, 1 row)", nbytes, raw, miss, hit,
                      "first read verified (not counted), then plain in both"))


def _miss_record(
    path: str, nbytes: int, raw: list[float], miss: list[float], hit: list[float],
    checksum: str, **extra: float,
) -> dict[str, Any]:
    med = statistics.median
    penalty = (med(miss) - med(hit)) / med(raw)
    return {
        "bench": "pool.miss_latency", "path": path, "expert_bytes": nbytes,
        "raw_load_expert_ms": _median_ms(raw), "miss_ms": _median_ms(miss),
        "hit_ms": _median_ms(hit), **extra,
        "ratio_miss_penalty": round(penalty, 3),
        "ratio_end_to_end": round(med(miss) / med(raw), 3),
        "checksum": checksum, "samples": len(miss),
        "goal": "miss penalty <= 1.2x raw load", "met": penalty <= 1.2,
    }


# ---------------------------------------------------------------- (d) cuda


def _cuda(args: argparse.Namespace, workdir: Path) -> None:
    """A Zipf(1.0) run through one CUDA actor core whose cache holds 8 of 64 experts.

    The device's peak (the allocator's max_memory_allocated over the whole run, above what was
    allocated before it) against the goal budget + one expert, and VRAM per request (each
    group's activation peak, from the same counters, as the server reports it).
    """
    if not torch.cuda.is_available():
        emit({"bench": "pool.cuda", "skipped": True, "reason": "no CUDA device: unmeasured"})
        return
    experts, resident, requests = 64, 8, (400 if args.quick else 2000)
    root, _ = build_store(workdir / "cuda", K=experts, n=64, width=1024, hidden=4, out=8)
    store = Store.open(root)
    expert_bytes = store.expert_nbytes(0)
    budget = resident * expert_bytes
    core = ActorCore(name="cuda", device="cuda", budget_bytes=budget)
    rng = np.random.default_rng(0)
    trace = zipf_trace(experts, requests, 1.0, seed=0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outcomes = []
    start = time.perf_counter()
    for expert_id in trace:
        rows = rng.standard_normal((int(rng.integers(1, 9)), 64)).astype(np.float32)
        outcome = core.run([(store.expert_ref(expert_id), rows)]).results[0]
        if outcome.error is not None:
            raise RuntimeError(outcome.error)
        outcomes.append(outcome)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base
    misses = [o for o in outcomes if not o.hit]
    hits = [o for o in outcomes if o.hit]
    vram = sorted(o.activation_bytes for o in outcomes)
    emit({
        "bench": "pool.cuda", "device": torch.cuda.get_device_name(),
        "experts": experts, "resident": resident, "requests": requests,
        "trace": "zipf(1.0), 1-8 rows a request",
        "expert_bytes": expert_bytes, "budget_bytes": budget,
        "peak_device_bytes": peak, "goal_bytes": budget + expert_bytes,
        "peak_within_goal": peak <= budget + expert_bytes,
        "peak_over_budget_bytes": peak - budget,
        "hit_rate": round(len(hits) / len(outcomes), 4),
        "miss_load_ms": round(statistics.median(o.load_ms for o in misses), 3),
        "compute_ms": round(statistics.median(o.compute_ms for o in outcomes), 3),
        "vram_per_request_bytes": {
            "p50": vram[len(vram) // 2], "p99": vram[int(len(vram) * 0.99)], "max": vram[-1],
        },
        "requests_per_s": round(requests / seconds, 1),
    })
    core.close()


async def main_async(args: argparse.Namespace) -> None:
    everything = {"batching", "hit_rate", "miss_latency", "cuda"}
    only = set(args.only.split(",")) if args.only else everything
    torch.set_num_threads(1)
    if "hit_rate" in only:
        _hit_rate(args)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.pool == "ray" and ({"batching", "miss_latency"} & only):
            import ray

            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        try:
            if "batching" in only:
                root, prototypes = build_store(
                    workdir / "small", K=32, n=8, width=128, hidden=2, out=1
                )
                opened = Store.open(root)
                tree = PrototypeTree.load(opened.router_path)
                refs = [opened.expert_ref(e.id) for e in opened.manifest.experts]
                settings = Settings(actors=1, cache_bytes=10**9)
                pool: ExpertPool
                if args.pool == "ray":
                    from server.pool import RayExpertPool

                    pool = RayExpertPool.create(settings)
                else:
                    pool = FakeExpertPool(settings)
                try:
                    await _batching(pool, tree, refs, prototypes, args, args.pool)
                finally:
                    await pool.close()
            if "miss_latency" in only:
                await _miss_latency(args, workdir, args.pool)
            if "cuda" in only:
                _cuda(args, workdir)
        finally:
            if args.pool == "ray" and ({"batching", "miss_latency"} & only):
                import ray

                ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--pool", choices=["ray", "fake"], default="ray",
                        help="Ray actors (default) or the in-process fake pool")
    parser.add_argument(
        "--only", default="", help="comma list: batching,hit_rate,miss_latency,cuda"
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
