"""The compositional MoMLP: one mixture of PReLU experts per node of a DAG.

Each node v is a MoMLP in its own d_v-dimensional input space: K_v prototypes, K_v experts
(ExpertMLP) and, once hardened, a PrototypeTree over the prototypes. While training, a node
mixes all its experts with the soft gate of eq. (39), softmax(−‖z − p_i‖); after `harden()`
it routes each row to one expert with its tree and runs only that expert.

`forward_hard` is made only of public per-node pieces, so a server can reproduce it wave by
wave: for each node in `waves`, `node_inputs` gathers its input columns, `nodes[v].route`
picks the expert per row, `nodes[v].experts[k]` computes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

from experts_store import ExpertArch, ExpertMLP
from router import Mode, PrototypeTree

from ._exceptions import NotHardened
from ._spec import INPUT, GraphSpec, InputRef, NodeSpec, parse_ref, validate, waves

__all__ = ["CompositionalMoMLP", "HardForward", "NodeMixture", "node_tree"]

_M = TypeVar("_M", bound=nn.Module)


class NodeMixture(nn.Module):
    """One node: K_v prototypes in R^{d_v}, K_v experts, and (after harden) a routing tree."""

    def __init__(self, spec: NodeSpec, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.spec = spec
        arch = ExpertArch(widths=spec.widths)
        self.prototypes = nn.Parameter(torch.zeros(spec.experts, spec.input_dim))
        self.experts = nn.ModuleList(
            ExpertMLP(arch, generator=generator) for _ in range(spec.experts)
        )
        self.tree: PrototypeTree | None = None
        self.routing: Mode = "tree"

    @property
    def num_experts(self) -> int:
        return self.spec.experts

    def gate(self, z: Tensor) -> Tensor:
        """softmax(−‖z − p_i‖) over the node's K_v prototypes, [B, K_v] (eq. 39)."""
        diff = z[:, None, :] - self.prototypes[None, :, :]
        # The epsilon keeps the norm's gradient finite when z sits on a prototype.
        return torch.softmax(-torch.sqrt((diff * diff).sum(dim=-1) + 1e-12), dim=1)

    def all_experts(self, z: Tensor) -> Tensor:
        """Every expert on every row, [B, K_v, out], as one batched product per layer.

        Training-time only: stacking the K_v small experts' weights costs a few tiny copies
        per step where K_v separate calls would cost K_v times the (dominant) call overhead.
        """
        experts = [e for e in self.experts if isinstance(e, ExpertMLP)]
        if self.spec.experts == 1 or experts[0].arch.batchnorm:
            return torch.stack([expert(z) for expert in experts], dim=1)
        h = z[:, None, :].expand(z.shape[0], len(experts), z.shape[1])
        last = len(experts[0].linears) - 1
        for j in range(last + 1):
            linears = [_module(e.linears[j], nn.Linear) for e in experts]
            weight = torch.stack([lin.weight for lin in linears])  # [K, out, in]
            bias = torch.stack([lin.bias for lin in linears])  # [K, out]
            h = torch.einsum("bki,koi->bko", h, weight) + bias
            if j < last:
                gamma = torch.stack(
                    [_module(e.activations[j], nn.PReLU).weight for e in experts]
                )  # [K, out]
                h = torch.where(h >= 0, h, gamma * h)
        return h

    def soft(self, z: Tensor) -> Tensor:
        """The dense training-time mixture Σ_i gate_i(z)·f_i(z), [B, out]."""
        if self.num_experts == 1:
            out: Tensor = self.experts[0](z)
            return out
        return (self.gate(z)[:, :, None] * self.all_experts(z)).sum(dim=1)

    def routed(self, z: Tensor, experts: Tensor) -> Tensor:
        """Training-time equivalent of `run` (equal up to float rounding): every expert
        computed, each row's own picked, so one step costs a few batched products."""
        if self.num_experts == 1:
            out: Tensor = self.experts[0](z)
            return out
        picked = experts[:, None, None].expand(z.shape[0], 1, self.spec.output_dim)
        return self.all_experts(z).gather(1, picked)[:, 0, :]

    def harden(self, routing: Mode = "tree", seed: int = 0) -> None:
        """Freeze the prototypes and build the ν-ary tree the node routes with from now on."""
        self.prototypes.requires_grad_(False)
        self.tree = node_tree(self.prototypes.detach().cpu(), self.spec.branching, seed)
        self.routing = routing

    def route(self, z: Tensor) -> Tensor:
        """The expert each row goes to, LongTensor [B] (the tree's walk, or exact nearest)."""
        if self.tree is None:
            raise NotHardened()
        if z.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=z.device)
        return self.tree.route(z.detach(), mode=self.routing).experts[:, 0].to(z.device)

    def run(self, z: Tensor, experts: Tensor) -> Tensor:
        """Row i through expert experts[i]: one call per expert used (differentiable)."""
        out = z.new_zeros(z.shape[0], self.spec.output_dim)
        for k in torch.unique(experts).tolist():
            rows = torch.nonzero(experts == k).flatten()
            out = out.index_copy(0, rows, self.experts[int(k)](z[rows]))
        return out


def node_tree(prototypes: Tensor, branching: int, seed: int) -> PrototypeTree:
    """A node's routing tree: balanced, so a row's walk costs at most ν⌈log_ν K_v⌉
    distance evaluations (the stats bound of graph stores), where the default k-means
    tree can be a level deeper on a lopsided split."""
    return PrototypeTree.build(prototypes, branching=branching, seed=seed, balanced=True)


@dataclass(frozen=True)
class HardForward:
    """outputs [B, out]; experts[v] LongTensor [B]: the one expert node v ran for each row;
    values[v] [B, out_v]: node v's outputs."""

    outputs: Tensor
    experts: dict[str, Tensor]
    values: dict[str, Tensor]


class CompositionalMoMLP(nn.Module):
    """A validated graph spec with one NodeMixture per node; soft `forward`, `forward_hard`."""

    def __init__(self, spec: GraphSpec, input_dim: int, *, seed: int = 0) -> None:
        super().__init__()
        self.spec = validate(spec, input_dim)
        self.input_dim = input_dim
        self.waves = waves(spec)
        generator = torch.Generator().manual_seed(seed)
        self.nodes = nn.ModuleDict(
            {node.name: NodeMixture(node, generator=generator) for node in spec.nodes}
        )
        self._refs = {
            node.name: [parse_ref(r, node=node.name) for r in node.inputs] for node in spec.nodes
        }
        self._out_refs = [parse_ref(r, node=r) for r in spec.outputs]

    def node(self, name: str) -> NodeMixture:
        node = self.nodes[name]
        assert isinstance(node, NodeMixture)
        return node

    @property
    def hardened(self) -> bool:
        return all(self.node(n.name).tree is not None for n in self.spec.nodes)

    def node_inputs(self, name: str, x: Tensor, values: Mapping[str, Tensor]) -> Tensor:
        """Node `name`'s input z [B, d_v], gathered from x and earlier nodes' outputs."""
        return torch.cat([_column(ref, x, values) for ref in self._refs[name]], dim=1)

    def gather_outputs(self, x: Tensor, values: Mapping[str, Tensor]) -> Tensor:
        """The graph's output [B, out] from its nodes' outputs."""
        return torch.cat([_column(ref, x, values) for ref in self._out_refs], dim=1)

    def soft_values(self, x: Tensor) -> dict[str, Tensor]:
        """Every node's output under the soft gates, wave by wave."""
        values: dict[str, Tensor] = {}
        for wave in self.waves:
            for name in wave:
                values[name] = self.node(name).soft(self.node_inputs(name, x, values))
        return values

    def forward(self, x: Tensor) -> Tensor:
        return self.gather_outputs(x, self.soft_values(x))

    def harden(self, routing: Mode = "tree", seed: int = 0) -> None:
        """Freeze every node's prototypes and build its tree; routing is hard from now on."""
        for node in self.spec.nodes:
            self.node(node.name).harden(routing, seed)

    def forward_hard(self, x: Tensor) -> HardForward:
        """Each node routes each row to one expert (its tree) and runs only that expert."""
        if not self.hardened:
            raise NotHardened()
        values: dict[str, Tensor] = {}
        chosen: dict[str, Tensor] = {}
        for wave in self.waves:
            for name in wave:
                node = self.node(name)
                z = self.node_inputs(name, x, values)
                chosen[name] = node.route(z)
                values[name] = node.run(z, chosen[name])
        return HardForward(self.gather_outputs(x, values), chosen, values)

    def forward_routed(self, x: Tensor) -> Tensor:
        """forward_hard's outputs computed the training way (`NodeMixture.routed`)."""
        values: dict[str, Tensor] = {}
        for wave in self.waves:
            for name in wave:
                node = self.node(name)
                z = self.node_inputs(name, x, values)
                values[name] = node.routed(z, node.route(z))
        return self.gather_outputs(x, values)

    def total_parameters(self) -> int:
        """Every expert's parameters plus the prototypes (what the store holds)."""
        return sum(p.numel() for p in self.parameters())

    def active_parameters(self) -> int:
        """Parameters one row touches when hard: one expert per node, plus the prototypes
        its tree walk compares against (bounded here by all of them)."""
        return sum(
            _module(self.node(n.name).experts[0], ExpertMLP).num_parameters()
            + self.node(n.name).prototypes.numel()
            for n in self.spec.nodes
        )


def _module(module: nn.Module, kind: type[_M]) -> _M:
    assert isinstance(module, kind)
    return module


def _column(ref: InputRef, x: Tensor, values: Mapping[str, Tensor]) -> Tensor:
    source = x if ref.source == INPUT else values[ref.source]
    if ref.column is None:
        return source
    return source[:, ref.column : ref.column + 1]
