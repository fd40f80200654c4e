"""A tiny trained graph store (seed 004) and its offline reading, for the graph tests."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.graph import (
    CompositionalMoMLP,
    GraphSpec,
    GraphTraining,
    HardForward,
    binary_tree_spec,
    graph_dataset,
    publish_graph,
    train_end_to_end,
)

D = 8  # inputs of the binary tree: 7 nodes in 3 waves


def tiny_graph_store(
    root: Path, *, seed: int = 0, experts: int = 4, reverse: bool = False
) -> CompositionalMoMLP:
    """A binary tree over 8 inputs, 4 experts per node, a few epochs; published at root.
    `reverse` lists its nodes root first, each before the nodes it reads."""
    spec = binary_tree_spec(D, experts=experts, hidden=(8,))
    if reverse:
        spec = GraphSpec(nodes=tuple(reversed(spec.nodes)), outputs=spec.outputs)
    x, y, _ = graph_dataset("tree8", 512, seed)
    model = CompositionalMoMLP(spec, D, seed=seed)
    train_end_to_end(
        model, x, y, GraphTraining(soft_epochs=2, hard_epochs=1, refit_every=1, seed=seed)
    )
    publish_graph(model, root)
    return model


def offline(model: CompositionalMoMLP, x: torch.Tensor) -> HardForward:
    with torch.no_grad():
        return model.forward_hard(x)


def global_ids(model: CompositionalMoMLP, hard: HardForward) -> dict[str, list[int]]:
    """Each node's expert per row as the store's global ids (nodes in spec order)."""
    ids: dict[str, list[int]] = {}
    offset = 0
    for node in model.spec.nodes:
        ids[node.name] = (hard.experts[node.name] + offset).tolist()
        offset += node.experts
    return ids


def inputs(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(rows, D, generator=generator) * 2 - 1
