"""The manifest block of a store of kind "graph": a DAG of small mixtures (seed 004).

Each node is a MoMLP in its own input space: its inputs are input coordinates (``x:i``) or
other nodes' outputs (``name`` for all of a node's columns, ``name:j`` for column j); its
K_v prototypes live in a router file of its own (`router.PrototypeTree`, content-named like
the store's router); prototype k routes to the manifest expert ``experts[k]`` (global ids,
ordinary rows of ``manifest.experts`` whose arch maps the node's arity d_v to its width).

    {"nodes": [{"name": "l0_0", "inputs": ["x:0", "x:1"], "output_dim": 1, "branching": 4,
                "router_file": "router-<sha16>.safetensors", "experts": [0, 1, 2, 3]}, ...],
     "outputs": ["root"]}

`GraphBlock.check` is what publishing and opening run: every refusal names its node. The
trainer has its own, richer spec (`trainer.graph.GraphSpec`); this block is what a store
holds once trained, and experts_store cannot import the trainer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["GraphBlock", "GraphNodeEntry", "node_ref"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_REF = re.compile(r"(?P<source>[A-Za-z_][A-Za-z0-9_]{0,63})(?::(?P<column>\d{1,9}))?")
_ROUTER = re.compile(r"router-[0-9a-f]{16}\.safetensors")
INPUT = "x"


class _Arch(Protocol):
    @property
    def input_dim(self) -> int: ...
    @property
    def output_dim(self) -> int: ...


def node_ref(ref: str) -> tuple[str, int | None]:
    """``x:3`` -> ("x", 3), ``n0`` -> ("n0", None), ``n0:1`` -> ("n0", 1); ValueError else."""
    match = _REF.fullmatch(ref)
    if match is None:
        raise ValueError(f"input {ref!r} is not 'x:i', 'node' or 'node:j'")
    column = match.group("column")
    return match.group("source"), None if column is None else int(column)


class GraphNodeEntry(BaseModel):
    """One node of the graph block."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    inputs: list[str] = Field(min_length=1, max_length=4096)
    output_dim: int = Field(ge=1)
    branching: int = Field(ge=2)
    router_file: str
    experts: list[int] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value) or value == INPUT:
            raise ValueError(f"node name {value!r} is not an identifier other than 'x'")
        return value

    @field_validator("router_file")
    @classmethod
    def _check_router(cls, value: str) -> str:
        # The exact pattern rules out paths: a node's router sits beside the store's.
        if not _ROUTER.fullmatch(value):
            raise ValueError(f"router_file {value!r} is not router-<sha16>.safetensors")
        return value

    @property
    def num_experts(self) -> int:
        return len(self.experts)


class GraphBlock(BaseModel):
    """manifest["graph"]: the nodes (any order) and the graph's output references."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: list[GraphNodeEntry] = Field(min_length=1, max_length=4096)
    outputs: list[str] = Field(min_length=1)

    def node(self, name: str) -> GraphNodeEntry:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    @property
    def router_files(self) -> set[str]:
        return {node.router_file for node in self.nodes}

    @property
    def edges(self) -> list[tuple[str, str]]:
        """(source, node) for every input reference; the source "x:i" is an input column."""
        return [
            (raw if node_ref(raw)[0] == INPUT else node_ref(raw)[0], node.name)
            for node in self.nodes
            for raw in node.inputs
        ]

    def width(self, ref: str, input_dim: int, *, node: str) -> int:
        """Columns `ref` contributes; ValueError naming `node` if it names nothing."""
        try:
            source, column = node_ref(ref)
        except ValueError as exc:
            raise ValueError(f"node {node!r}: {exc}") from None
        if source == INPUT:
            if column is None or column >= input_dim:
                raise ValueError(f"node {node!r}: input {ref!r} is not a column of x")
            return 1
        try:
            width = self.node(source).output_dim
        except KeyError:
            raise ValueError(f"node {node!r}: input {ref!r} names no node") from None
        if column is not None and column >= width:
            raise ValueError(f"node {node!r}: input {ref!r} is past {source}'s {width} columns")
        return width if column is None else 1

    def waves(self) -> list[list[str]]:
        """Node names in topological waves (spec order within a wave); ValueError naming a
        node on a cycle."""
        names = [node.name for node in self.nodes]
        needs = {
            node.name: {node_ref(r)[0] for r in node.inputs} & set(names) for node in self.nodes
        }
        placed: set[str] = set()
        result: list[list[str]] = []
        while len(placed) < len(names):
            ready = [n for n in names if n not in placed and needs[n] <= placed]
            if not ready:
                stuck = next(n for n in names if n not in placed)
                raise ValueError(f"node {stuck!r}: is on a cycle of inputs")
            result.append(ready)
            placed.update(ready)
        return result

    def check(self, input_dim: int, output_dim: int, archs: Sequence[_Arch]) -> None:
        """Refuse a graph that cannot be served, naming the node (ValueError).

        `archs[i]` is manifest expert i's arch. Checked: unique names; every input defined;
        each node's experts exist, belong to it alone and map its arity to its output width;
        every expert belongs to a node; acyclic; the outputs' total width is `output_dim`.
        """
        seen: set[str] = set()
        owner: dict[int, str] = {}
        for node in self.nodes:
            if node.name in seen:
                raise ValueError(f"node {node.name!r}: is defined twice")
            seen.add(node.name)
        for node in self.nodes:
            arity = sum(self.width(r, input_dim, node=node.name) for r in node.inputs)
            for expert in node.experts:
                if not 0 <= expert < len(archs):
                    raise ValueError(f"node {node.name!r}: expert {expert} is not in the store")
                if expert in owner:
                    raise ValueError(
                        f"node {node.name!r}: expert {expert} already belongs to node "
                        f"{owner[expert]!r}"
                    )
                owner[expert] = node.name
                arch = archs[expert]
                if (arch.input_dim, arch.output_dim) != (arity, node.output_dim):
                    raise ValueError(
                        f"node {node.name!r}: expert {expert} maps {arch.input_dim} -> "
                        f"{arch.output_dim}, the node's inputs are {arity} wide and its "
                        f"output {node.output_dim}"
                    )
        orphans = sorted(set(range(len(archs))) - set(owner))
        if orphans:
            raise ValueError(f"experts {orphans[:10]} belong to no node of the graph")
        self.waves()
        width = 0
        for ref in self.outputs:
            if node_ref(ref)[0] == INPUT:
                raise ValueError(f"output {ref!r} must name a node")
            width += self.width(ref, input_dim, node=ref)
        if width != output_dim:
            raise ValueError(f"the outputs are {width} wide, the store's output_dim {output_dim}")
