"""Hit rate across a hot swap: does a republish keep the unchanged experts warm? (issue 13)

A real app over a real Ray pool (2 actors on a 2-CPU embedded Ray, room for 20 experts each)
serves Zipf(1.0) traffic over 200 experts. After a warm-up, the store is republished with a
fraction of its experts changed (new weights; the rest byte-identical) and swapped in with
`POST /v1/admin/reload`. Printed, one JSON line per changed fraction: the hit rate of the
1,000 requests before the swap and of the 1,000 after it, and their ratio. The device cache
is keyed by content, so only changed experts should miss; the 100% line is what a cache keyed
by store version would see on every swap.

    python benchmarks/hot_swap.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import torch

from experts_store import ExpertArch, ExpertMLP, StoreWriter
from router import PrototypeTree
from server import Settings, create_app
from server.pool import ray_session

K, N, OUT = 200, 16, 8
ARCH = ExpertArch(widths=(N, 256, 256, OUT))


def publish(
    root: Path, prototypes: torch.Tensor, seeds: list[int], *, retire_after_s: float | None = None
) -> dict[int, str]:
    """Publish K experts, expert e's weights drawn from seeds[e]; returns id -> sha256.
    `retire_after_s`: the writer's (its default when None)."""
    writer = (
        StoreWriter(root) if retire_after_s is None
        else StoreWriter(root, retire_after_s=retire_after_s)
    )
    with writer:
        for expert_id, seed in enumerate(seeds):
            generator = torch.Generator().manual_seed(seed)
            writer.add_expert(expert_id, ExpertMLP(ARCH, generator=generator))
        PrototypeTree.build(prototypes, branching=4, seed=0).save(writer.router_path)
        manifest = writer.publish(
            task="regression", input_dim=N, output_dim=OUT, routing="tree", branching=4
        )
    return {e.id: e.sha256 for e in manifest.experts}


def traffic(
    prototypes: torch.Tensor, ranking: np.ndarray, count: int, rng: np.random.Generator
) -> np.ndarray:
    """`count` one-row requests whose experts follow Zipf(1.0) over `ranking` (most asked
    for first). One ranking for the whole run: only the store changes at the swap."""
    weights = 1.0 / np.arange(1, K + 1)
    picks = ranking[rng.choice(K, size=count, p=weights / weights.sum())]
    noise = 0.01 * rng.standard_normal((count, N))
    rows: np.ndarray = prototypes.numpy()[picks] + noise
    return rows


async def hit_rate(client: httpx.AsyncClient, rows: np.ndarray, concurrency: int = 8) -> float:
    """Hits over (request, expert) lookups, as the requests' own stats report them."""
    hits = lookups = 0
    queue: asyncio.Queue[np.ndarray] = asyncio.Queue()
    for row in rows:
        queue.put_nowait(row)

    async def worker() -> None:
        nonlocal hits, lookups
        while not queue.empty():
            row = queue.get_nowait()
            body = {"inputs": [row.tolist()], "return_stats": True}
            response = await client.post("/v1/predict", json=body)
            response.raise_for_status()
            for stat in response.json()["stats"]["experts"]:
                lookups += 1
                hits += stat["cache"] == "hit"

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return hits / max(lookups, 1)


async def one_swap(fraction: float, args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    rng = np.random.default_rng(0)
    ranking = rng.permutation(K)
    generator = torch.Generator().manual_seed(0)
    prototypes = torch.randn(K, N, generator=generator)
    root = workdir / f"store-{fraction}"
    seeds = list(range(1, K + 1))
    before_keys = publish(root, prototypes, seeds)
    nbytes = ARCH.nbytes()
    settings = Settings(
        store=root, actors=2, cache_bytes=20 * nbytes, watch_store=False, max_batch_wait_ms=1.0
    )
    app = create_app(settings)
    warm, measured = (1000, 1000) if args.quick else (3000, 1000)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            await hit_rate(client, traffic(prototypes, ranking, warm, rng))
            before = await hit_rate(client, traffic(prototypes, ranking, measured, rng))
            changed = rng.choice(K, size=round(fraction * K), replace=False)
            for expert_id in changed:
                seeds[int(expert_id)] += 10_000
            after_keys = publish(root, prototypes, seeds)
            reload = await client.post("/v1/admin/reload")
            assert reload.json()["reloaded"], reload.text
            rows = traffic(prototypes, ranking, measured, rng)
            first = await hit_rate(client, rows[:100])
            rest = await hit_rate(client, rows[100:])
            after = (100 * first + (measured - 100) * rest) / measured
    unchanged = sum(before_keys[e] == after_keys[e] for e in range(K))
    ratio = after / before if before else 0.0
    return {
        "bench": "hot_swap.hit_rate",
        "changed_fraction": fraction,
        "unchanged_experts": unchanged,
        "hit_rate_before": round(before, 3),
        "hit_rate_after": round(after, 3),
        "hit_rate_first_100_after": round(first, 3),
        "ratio": round(ratio, 3),
        "requests_each": measured,
        "goal": "ratio >= 0.9 at 10% changed",
        "met": ratio >= 0.9 if fraction <= 0.1 else None,
    }


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for fraction in (0.1, 1.0):
            record = await one_swap(fraction, args, Path(tmp))
            record.update(
                machine=platform.machine(),
                cpus=os.cpu_count(),
                when=datetime.now(UTC).isoformat(timespec="seconds"),
            )
            print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter warm-up")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    with ray_session(num_cpus=2):
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
