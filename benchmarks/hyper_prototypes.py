"""Prototype-conditioned experts (issue 17, item 3): K experts stored as one f + K prototypes.

Builds `momlp build --kind hyper --condition-source prototype` on ackley2d (grid 128, K
prototypes, g: 2 → 10 → 1, f of depth 2 and width 100), materializes it as an ordinary
K-expert store (`momlp store materialize`), serves both in-process (the real ActorCore caches
behind the fake pool) on the same rows and compares. Printed, one JSON line: the bytes of each
store on disk, their ratio, K·|g| (parameter bytes), and whether the outputs are bitwise equal.

    python benchmarks/hyper_prototypes.py [--quick] [--experts 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from experts_store import Store, materialize_store
from server import Settings, create_app
from server.pool import FakeExpertPool
from trainer.hyper import PrototypeBuildConfig, build_prototype_store


def disk_bytes(root: Path) -> int:
    """Bytes of the files the live manifest references, plus the manifest itself."""
    store = Store.open(root)
    files = store.manifest.referenced_files | {"manifest.json"}
    return sum((root / name).stat().st_size for name in files)


async def serve(root: Path, x: np.ndarray) -> list[list[float]]:
    settings = Settings(store=root, watch_store=False, actors=2, cache_bytes=64 << 20,
                        max_batch_wait_ms=0.0, max_rows=4096)
    app = create_app(settings, pool_factory=FakeExpertPool)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
            r = await client.post("/v1/predict", json={"inputs": x.tolist()}, timeout=600)
            r.raise_for_status()
            outputs: list[list[float]] = r.json()["outputs"]
            return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs")
    parser.add_argument("--experts", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hyper_root, plain_root = Path(tmp) / "hyper", Path(tmp) / "plain"
        started = time.perf_counter()
        manifest = build_prototype_store(
            PrototypeBuildConfig(out=hyper_root, dataset="ackley2d", grid_size=128,
                                 experts=args.experts, epochs=2 if args.quick else 10),
            progress=False,
        )
        build_s = time.perf_counter() - started
        started = time.perf_counter()
        plain = materialize_store(hyper_root, plain_root)
        materialize_s = time.perf_counter() - started
        spec = manifest.hyper
        assert spec is not None
        x = np.random.default_rng(0).uniform(-1, 1, size=(2000, 2)).astype(np.float32)
        a = asyncio.run(serve(hyper_root, x))
        b = asyncio.run(serve(plain_root, x))
        report: dict[str, Any] = Store.open(hyper_root).report() or {}
        hyper_bytes, plain_bytes = disk_bytes(hyper_root), disk_bytes(plain_root)
        record = {
            "bench": "hyper_prototypes",
            "experts": args.experts,
            "hyper_store_bytes": hyper_bytes,
            "f_bytes": spec.hypernetwork.bytes,
            "prototype_table_bytes": spec.conditions.bytes if spec.conditions else 0,
            "materialized_store_bytes": plain_bytes,
            "ratio_hyper_to_materialized": round(hyper_bytes / plain_bytes, 4),
            "k_times_g_param_bytes": args.experts * spec.theta_nbytes,
            "ratio_hyper_to_k_g": round(hyper_bytes / (args.experts * spec.theta_nbytes), 4),
            "materialized_experts": plain.num_experts,
            "outputs_bitwise_equal": a == b,
            "rows_compared": len(x),
            "test_mse": report.get("hypernetwork", {}).get("value"),
            "build_s": round(build_s, 1),
            "materialize_s": round(materialize_s, 1),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
        }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
