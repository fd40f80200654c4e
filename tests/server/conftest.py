"""Fixtures for the serving runtime: a small real store on disk, built in a tmp dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from experts_store import ExpertArch, ExpertMLP, StoreWriter

MakeStore = Callable[..., Path]


@pytest.fixture(autouse=True)
def cpu_actors_unless_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the layers above the pool against the CPU actor's figures (two
    actors, activation bytes from tensor sizes, CPU bits). On a GPU machine `device=auto`
    would give one CUDA actor, so settings that name no device get CPU ones; the `gpu` tests
    and tests/integration (real servers, `auto`) cover CUDA actors."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("MOMLP_DEVICE", "cpu")


def build_store(
    root: Path,
    *,
    K: int = 8,
    n: int = 4,
    width: int = 16,
    out: int = 2,
    hidden_layers: int = 1,
    branching: int = 4,
    seed: int = 0,
) -> Path:
    """Publish a store of K random PReLU experts (n -> width^hidden_layers -> out) and a
    prototype tree over K random prototypes; returns the store root."""
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(seed)
    arch = ExpertArch(widths=(n, *([width] * hidden_layers), out))
    prototypes = torch.randn(K, n, generator=generator)
    with StoreWriter(root) as writer:
        for expert_id in range(K):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        PrototypeTree.build(prototypes, branching=branching, seed=seed).save(writer.router_path)
        writer.publish(
            task="regression", input_dim=n, output_dim=out, routing="tree", branching=branching
        )
    return root


@pytest.fixture
def make_store(tmp_path: Path) -> MakeStore:
    """`make_store(K=..., n=..., width=...)` -> root of a fresh store under tmp_path."""
    counter = iter(range(1_000_000))

    def make(**kwargs: int) -> Path:
        return build_store(tmp_path / f"store{next(counter)}", **kwargs)

    return make
