"""The graph spec: a DAG of nodes, each a MoMLP in its own low-dimensional input space.

JSON form (what `GraphSpec.from_dict` reads and `to_dict` writes):

    {"nodes": [{"name": "n0", "inputs": ["x:0", "x:1"], "experts": 4, "branching": 4,
                "widths": [2, 8, 8, 1]}, ...],
     "outputs": ["root"]}

An input reference is ``x:i`` (input coordinate i), ``name`` (every output column of node
`name`) or ``name:j`` (its column j). ``widths`` are the expert's ExpertArch widths: input
dim first (it must equal the total width of the inputs), output width last.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._exceptions import (
    ArityMismatch,
    GraphCycle,
    GraphSpecError,
    MissingOutput,
    UndefinedInput,
)

__all__ = [
    "MAX_EXPERT_PARAMS",
    "GraphSpec",
    "InputRef",
    "NodeSpec",
    "binary_tree_spec",
    "output_width",
    "parse_ref",
    "validate",
    "waves",
]

# One expert's parameters at most: 1 GiB of float32, far beyond a node of a few inputs.
MAX_EXPERT_PARAMS = 1 << 28

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
INPUT = "x"  # the reserved source name: ``x:i`` is input coordinate i


@dataclass(frozen=True)
class InputRef:
    """One input reference: `source` is "x" or a node name; `column` None means all columns."""

    source: str
    column: int | None


def parse_ref(ref: str, *, node: str) -> InputRef:
    """``x:3`` / ``n0`` / ``n0:1`` as an InputRef; UndefinedInput if it is none of those."""
    name, sep, col = ref.partition(":")
    if not _NAME.match(name) or (sep and not col.isdigit()) or (name == INPUT and not sep):
        raise UndefinedInput(node=node, ref=ref)
    return InputRef(name, int(col) if sep else None)


@dataclass(frozen=True)
class NodeSpec:
    """One node: its inputs, K_v experts under a ν-ary prototype tree, its experts' widths."""

    name: str
    inputs: tuple[str, ...]
    widths: tuple[int, ...]
    experts: int = 1
    branching: int = 4

    @property
    def input_dim(self) -> int:
        return self.widths[0]

    @property
    def output_dim(self) -> int:
        return self.widths[-1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inputs": list(self.inputs),
            "widths": list(self.widths),
            "experts": self.experts,
            "branching": self.branching,
        }

    @classmethod
    def from_dict(cls, data: Any) -> NodeSpec:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise GraphSpecError("every node must be an object with a string name", node="")
        name = data["name"]
        unknown = set(data) - {"name", "inputs", "widths", "experts", "branching"}
        if unknown:
            raise GraphSpecError(f"unknown keys {sorted(unknown)}", node=name)
        inputs, widths = data.get("inputs"), data.get("widths")
        if not isinstance(inputs, list) or not all(isinstance(r, str) for r in inputs):
            raise GraphSpecError("inputs must be a list of strings", node=name)
        if not isinstance(widths, list) or not all(_is_int(w) for w in widths):
            raise GraphSpecError("widths must be a list of ints", node=name)
        experts, branching = data.get("experts", 1), data.get("branching", 4)
        if not _is_int(experts) or not _is_int(branching):
            raise GraphSpecError("experts and branching must be ints", node=name)
        return cls(name, tuple(inputs), tuple(widths), experts, branching)


@dataclass(frozen=True)
class GraphSpec:
    nodes: tuple[NodeSpec, ...]
    outputs: tuple[str, ...]

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [n.to_dict() for n in self.nodes], "outputs": list(self.outputs)}

    @classmethod
    def from_dict(cls, data: Any) -> GraphSpec:
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
            raise GraphSpecError("a spec is an object with a list of nodes", node="")
        outputs = data.get("outputs", [])
        if isinstance(outputs, str):
            outputs = [outputs]
        if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
            raise GraphSpecError("outputs must be a list of node references", node="")
        return cls(tuple(NodeSpec.from_dict(n) for n in data["nodes"]), tuple(outputs))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ref_width(ref: InputRef, nodes: dict[str, NodeSpec], *, node: str, raw: str) -> int:
    """Columns a reference contributes; UndefinedInput if it names nothing that exists."""
    if ref.source == INPUT:
        return 1
    if ref.source not in nodes:
        raise UndefinedInput(node=node, ref=raw)
    width = nodes[ref.source].output_dim
    if ref.column is None:
        return width
    if ref.column >= width:
        raise UndefinedInput(node=node, ref=raw)
    return 1


def validate(spec: GraphSpec, input_dim: int) -> GraphSpec:
    """Refuse a graph that cannot be trained, naming the node; return it unchanged if sound.

    Checked: node names (identifiers, unique, not "x"), sizes (K_v >= 1, ν >= 2, widths
    positive), every input defined (``x:i`` with i < input_dim, node names, their columns),
    arity (sum of input widths) == widths[0], acyclicity, and outputs naming defined nodes.
    """
    nodes: dict[str, NodeSpec] = {}
    for node in spec.nodes:
        if not _NAME.match(node.name) or node.name == INPUT:
            raise GraphSpecError("a node name is an identifier other than 'x'", node=node.name)
        if node.name in nodes:
            raise GraphSpecError("is defined twice", node=node.name)
        if node.experts < 1 or node.branching < 2:
            raise GraphSpecError("needs experts >= 1 and branching >= 2", node=node.name)
        if len(node.widths) < 2 or min(node.widths) < 1 or not node.inputs:
            raise GraphSpecError("needs inputs and positive widths [in, ..., out]", node=node.name)
        params = sum(a * b + b for a, b in zip(node.widths, node.widths[1:], strict=False))
        if params > MAX_EXPERT_PARAMS:
            # Else torch's allocation fails mid-build, or the machine runs out of memory.
            raise GraphSpecError(
                f"widths {list(node.widths)} make experts of {params} parameters, more than "
                f"{MAX_EXPERT_PARAMS}", node=node.name,
            )
        nodes[node.name] = node
    for node in spec.nodes:
        arity = 0
        for raw in node.inputs:
            ref = parse_ref(raw, node=node.name)
            if ref.source == INPUT and (ref.column is None or ref.column >= input_dim):
                raise UndefinedInput(node=node.name, ref=raw)
            arity += _ref_width(ref, nodes, node=node.name, raw=raw)
        if arity != node.input_dim:
            raise ArityMismatch(node=node.name, arity=arity, expert_input_dim=node.input_dim)
    if not spec.outputs:
        raise MissingOutput(node="")
    for raw in spec.outputs:
        ref = parse_ref(raw, node=raw)
        if ref.source not in nodes:
            raise MissingOutput(node=raw)
        _ref_width(ref, nodes, node=raw, raw=raw)
    waves(spec)  # raises GraphCycle
    return spec


def output_width(spec: GraphSpec) -> int:
    """Columns of the graph's output: its outputs' widths summed (`spec` must be valid)."""
    nodes = {n.name: n for n in spec.nodes}
    return sum(_ref_width(parse_ref(raw, node=raw), nodes, node=raw, raw=raw)
               for raw in spec.outputs)


def waves(spec: GraphSpec) -> list[list[str]]:
    """Node names in topological waves: a node's inputs all come from earlier waves.

    Within a wave nodes keep their order in the spec. GraphCycle names a node on a cycle.
    """
    names = [n.name for n in spec.nodes]
    deps = {n.name: _node_deps(n, set(names)) for n in spec.nodes}
    done: set[str] = set()
    result: list[list[str]] = []
    while len(done) < len(names):
        wave = [n for n in names if n not in done and deps[n] <= done]
        if not wave:
            stuck = [n for n in names if n not in done]
            raise GraphCycle(node=stuck[0], cycle=_find_cycle(stuck[0], deps, done))
        result.append(wave)
        done.update(wave)
    return result


def _node_deps(node: NodeSpec, names: set[str]) -> set[str]:
    deps = set()
    for raw in node.inputs:
        source = raw.partition(":")[0]
        if source in names:
            deps.add(source)
    return deps


def _find_cycle(start: str, deps: dict[str, set[str]], done: set[str]) -> tuple[str, ...]:
    """A cycle reachable from `start` among the unfinished nodes, as a closed path."""
    path: list[str] = []
    current = start
    while current not in path:
        path.append(current)
        current = sorted(deps[current] - done)[0]
    cycle = path[path.index(current) :]
    return (*cycle, current)


def binary_tree_spec(
    input_dim: int, *, experts: int, hidden: Sequence[int], branching: int = 4
) -> GraphSpec:
    """The binary tree over input_dim (a power of two) inputs: input_dim - 1 nodes of arity 2.

    Level 0 pairs (x:0, x:1), (x:2, x:3), ...; each later level pairs the previous level's
    nodes; the last node, "root", is the output. Node names are ``l{level}_{index}``.
    """
    if input_dim < 2 or input_dim & (input_dim - 1):
        raise GraphSpecError(f"a binary tree needs a power of two >= 2 inputs, got {input_dim}",
                             node="")
    widths = (2, *hidden, 1)
    nodes: list[NodeSpec] = []
    level_refs = [f"x:{i}" for i in range(input_dim)]
    level = 0
    while len(level_refs) > 1:
        pairs = [level_refs[i : i + 2] for i in range(0, len(level_refs), 2)]
        last = len(pairs) == 1
        names = ["root" if last else f"l{level}_{j}" for j in range(len(pairs))]
        nodes += [
            NodeSpec(name, tuple(pair), widths, experts, branching)
            for name, pair in zip(names, pairs, strict=True)
        ]
        level_refs = names
        level += 1
    return GraphSpec(tuple(nodes), ("root",))
