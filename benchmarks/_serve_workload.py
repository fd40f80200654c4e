"""The serving benchmarks' store and workload: a store of random-weight experts (built on
first use) and the seeded requests sent to it, with the flags that choose them
(`vs_ray_serve.py`, `serve_ab.py`, `http_floor.py`, `server_path.py`, ...)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experts_store import ExpertArch, ExpertMLP, Store, StoreWriter
from router import PrototypeTree

__all__ = [
    "ISSUE_WORKLOAD",
    "add_workload_args",
    "build_store",
    "make_workload",
    "open_or_build",
    "prepare",
]

# The issue-19 workload (its independent run): 200 experts of 0.55 MB, 20 per actor, 4-row
# requests; `add_workload_args(parser, store=..., **ISSUE_WORKLOAD)` makes it the default.
ISSUE_WORKLOAD: dict[str, Any] = {
    "experts": 200, "widths": "16,256,512,8", "experts_per_actor": 20, "rows_per_request": 4,
}  # fmt: skip


def build_store(root: Path, *, experts: int, widths: tuple[int, ...], seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    arch = ExpertArch(widths=widths)
    with StoreWriter(root) as writer:
        for expert_id in range(experts):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        prototypes = torch.randn(experts, widths[0], generator=generator)
        PrototypeTree.build(prototypes, branching=4, seed=seed).save(writer.router_path)
        writer.publish(
            task="regression",
            input_dim=widths[0],
            output_dim=widths[-1],
            routing="tree",
            branching=4,
            extra={"note": "random-weight experts for the vs_ray_serve benchmark"},
        )
    return root


def open_or_build(root: Path, *, experts: int, widths: tuple[int, ...], seed: int) -> Store:
    if (root / "manifest.json").exists():
        store = Store.open(root)
        entry = store.manifest.experts[0]
        if store.manifest.num_experts == experts and tuple(entry.arch["widths"]) == widths:
            return store
        raise SystemExit(f"{root} holds another store; pass a fresh --store")
    return Store.open(build_store(root, experts=experts, widths=widths, seed=seed))


def make_workload(
    store: Store, *, count: int, seed: int, rows_per_request: int = 1
) -> list[tuple[int, list[list[float]]]]:
    """`count` requests of `rows_per_request` rows, each row drawn as an (expert, row) pair:
    Zipf(1.0) over a seeded ranking of the experts, the row near the expert's prototype and
    verified (tree routing) to reach it. A request is (its first row's expert, its rows)."""
    tree = PrototypeTree.load(store.router_path)
    rng = np.random.default_rng(seed)
    k = tree.num_prototypes
    prototypes = tree.prototypes.numpy().astype(np.float32)
    pools: dict[int, list[np.ndarray]] = {e: [] for e in range(k)}
    for scale in (0.05, 0.01, 0.0):
        missing = [e for e in range(k) if len(pools[e]) < 4]
        if not missing:
            break
        base = np.repeat(prototypes[missing], 8, axis=0)
        candidates = base + scale * rng.standard_normal(base.shape).astype(np.float32)
        routed = tree.route(candidates, mode="tree").experts[:, 0].numpy()
        for row, expert_id in zip(candidates, routed, strict=True):
            pools[int(expert_id)].append(row)
    servable = [e for e in range(k) if pools[e]]
    ranking = rng.permutation(servable)
    weights = 1.0 / np.arange(1, len(ranking) + 1)
    draws = rng.choice(ranking, size=count * rows_per_request, p=weights / weights.sum())
    rows = [pools[int(e)][int(rng.integers(len(pools[int(e)])))].tolist() for e in draws]
    return [
        (int(draws[i]), rows[i : i + rows_per_request])
        for i in range(0, len(rows), rows_per_request)
    ]

def prepare(
    args: argparse.Namespace,
) -> tuple[Store, tuple[int, ...], int, list[tuple[int, list[list[float]]]]]:
    """The store (built on first use), its widths and largest expert, and the workload; sets
    `args.budget` (bytes per actor) from `--experts-per-actor`."""
    torch.set_num_threads(1)
    widths = tuple(int(w) for w in args.widths.split(","))
    store = open_or_build(args.store, experts=args.experts, widths=widths, seed=args.seed)
    expert_bytes = max(store.expert_nbytes(e) for e in range(store.manifest.num_experts))
    args.budget = args.experts_per_actor * expert_bytes
    work = make_workload(
        store,
        count=args.warmup + args.requests,
        seed=args.seed,
        rows_per_request=args.rows_per_request,
    )
    return store, widths, expert_bytes, work


def add_workload_args(
    parser: argparse.ArgumentParser,
    *,
    store: str = "momlp-vs-rs",
    experts: int = 256,
    widths: str = "32,512,512,8",
    experts_per_actor: int = 16,
    rows_per_request: int = 1,
) -> None:
    """The store, actor and load flags that `prepare` reads, shared by the serving benchmarks
    (defaults: this script's workload; `store` is a folder in the temporary directory)."""
    parser.add_argument("--store", type=Path, default=Path(tempfile.gettempdir()) / store)
    parser.add_argument("--experts", type=int, default=experts)
    parser.add_argument("--widths", default=widths, help="expert widths d0,...,dout")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--experts-per-actor", type=int, default=experts_per_actor)
    parser.add_argument(
        "--rows-per-request",
        type=int,
        default=rows_per_request,
        help="rows in each request (the issue's independent run used 4)",
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ray-num-cpus", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
