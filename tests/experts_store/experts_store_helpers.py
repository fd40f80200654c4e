"""Helpers for the experts_store tests: small random experts and published stores."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import torch

from experts_store import ExpertArch, ExpertMLP, Manifest, StoreWriter

PublishStore = Callable[..., Manifest]


def stand_in_router(num_prototypes: int, dim: int, seed: int = 0) -> bytes:
    """The file of a prototype tree over K random points in R^n: these tests never route,
    but `momlp store verify` opens the store as a server does, which reads the whole tree."""
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(num_prototypes, dim, generator=generator)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "router.safetensors"
        PrototypeTree.build(points, branching=2, seed=seed).save(path)
        return path.read_bytes()


def make_expert(
    widths: tuple[int, ...] = (3, 8, 8, 2), *, batchnorm: bool = False, seed: int = 0
) -> ExpertMLP:
    """A random expert; with BatchNorm its running stats are moved off their init values."""
    gen = torch.Generator().manual_seed(seed)
    expert = ExpertMLP(ExpertArch(widths=widths, batchnorm=batchnorm), generator=gen)
    if batchnorm:
        expert.train()
        with torch.no_grad():
            for _ in range(3):
                expert(torch.randn(32, widths[0], generator=gen) * 2 + 1)
    return expert.eval()


def publish(
    root: Path,
    *,
    num_experts: int = 3,
    seed: int = 0,
    widths: tuple[int, ...] = (3, 8, 2),
    now: Callable[[], datetime] | None = None,
) -> Manifest:
    """Publish ``num_experts`` random experts (and a stand-in router file) under ``root``;
    ``now`` is the writer's clock."""
    with StoreWriter(root, now=now) as writer:
        return publish_with(writer, num_experts=num_experts, seed=seed, widths=widths)


def publish_with(
    writer: StoreWriter,
    *,
    num_experts: int = 3,
    seed: int = 0,
    widths: tuple[int, ...] = (3, 8, 2),
) -> Manifest:
    """`publish`'s store, staged and published by `writer`."""
    for expert_id in range(num_experts):
        writer.add_expert(expert_id, make_expert(widths, seed=seed * 1000 + expert_id))
    writer.router_path.write_bytes(stand_in_router(num_experts, widths[0], seed))
    writer.write_report({"seed": seed})
    return writer.publish(
        task="regression",
        input_dim=widths[0],
        output_dim=widths[-1],
        routing="tree",
        branching=2,
    )
