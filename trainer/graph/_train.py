"""Training a CompositionalMoMLP: end to end (no targets inside) or node by node.

End to end: prototypes start as k-means centroids of each node's inputs under the initial
network; `soft_epochs` of Adam on the graph's loss with every node's dense eq.-(39) gate
(experts and prototypes learn); every `refit_every` epochs the prototypes of internal nodes
(those reading another node's output) are refitted by k-means on a sample of their current
inputs, because those inputs move as the upstream nodes learn. Then `harden()` and
`hard_epochs` more of Adam through `forward_hard` (prototypes frozen, each row through one
expert per node), so what is served is what was trained.

Nodewise: with an observed target per node, each node is an independent Algorithm 2 run
(eq.-(39) prototypes, deepen, one expert per cell) on inputs taken from the data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from experts_store import ExpertArch, ExpertMLP
from router import Mode

from .._prototypes import kmeans_prototypes, learned_prototypes
from .._train import adam, rescale_output, target_scaling, train_network
from ._model import CompositionalMoMLP, NodeMixture, node_tree
from ._spec import INPUT, parse_ref

__all__ = [
    "MAX_SEED",
    "GraphHistory",
    "GraphTraining",
    "refit_prototypes",
    "train_end_to_end",
    "train_nodewise",
]

logger = logging.getLogger(__name__)

# sklearn's KMeans (the prototypes' refits) takes random_state in [0, 2**32 - 1].
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class GraphTraining:
    """Options of both trainings (regression, MSE). Targets should be on a unit scale."""

    soft_epochs: int = 40
    hard_epochs: int = 40
    lr: float = 1e-3
    prototype_lr: float | None = None  # default: lr
    batch_size: int = 128
    refit_every: int = 5  # epochs between k-means refits of internal prototypes (0: never)
    refit_sample: int = 2048  # rows the refit's k-means sees
    routing: Mode = "tree"
    seed: int = 0
    # Nodewise only: epochs of the eq.-(39) joint phase, then per-cell epochs after deepening.
    prototype_epochs: int = 20
    expert_epochs: int = 40
    # After training: epochs of the per-node fine-tune, rest of the graph frozen (0: off).
    finetune_epochs: int = 0


@dataclass
class GraphHistory:
    soft_losses: list[float] = field(default_factory=list)
    hard_losses: list[float] = field(default_factory=list)
    refits: int = 0


def _is_internal(model: CompositionalMoMLP, name: str) -> bool:
    return any(ref.source != INPUT for ref in (parse_ref(r, node=name)
                                               for r in model.spec.node(name).inputs))


@torch.no_grad()
def refit_prototypes(
    model: CompositionalMoMLP, x: Tensor, *, nodes: list[str] | None = None, seed: int = 0
) -> None:
    """Set the prototypes of `nodes` (default: all with K_v > 1) to k-means centroids of their
    current soft inputs on x; each new centroid takes the slot of the old prototype it is
    matched to (Hungarian, on distance), so expert k keeps roughly its cell."""
    from scipy.optimize import linear_sum_assignment

    values = model.soft_values(x)
    for name in nodes if nodes is not None else [n.name for n in model.spec.nodes]:
        node = model.node(name)
        if node.num_experts == 1:
            continue
        z = model.node_inputs(name, x, values).cpu().numpy().astype(np.float32)
        centers = kmeans_prototypes(z, node.num_experts, seed=seed)
        old = node.prototypes.detach().cpu()
        cost = torch.cdist(old.to(torch.float64), centers.to(torch.float64)).numpy()
        slots, picks = linear_sum_assignment(cost)
        matched = centers[torch.as_tensor(picks)[np.argsort(slots)]]
        node.prototypes.copy_(matched.to(node.prototypes))


def train_end_to_end(
    model: CompositionalMoMLP,
    x: Tensor,
    y: Tensor,
    settings: GraphTraining,
    *,
    on_epoch: Callable[[str, int, float], None] | None = None,
) -> GraphHistory:
    """Soft phase, harden, hard phase (see the module doc). Leaves `model` hardened, in eval.

    x [N, n] and y [N, out] live on the model's device; on_epoch(phase, epoch, mean_loss).
    """
    generator = torch.Generator().manual_seed(settings.seed)
    history = GraphHistory()
    sample = x[torch.randperm(x.shape[0], generator=generator)[: settings.refit_sample]]
    refit_prototypes(model, sample, seed=settings.seed)
    internal = [n.name for n in model.spec.nodes if _is_internal(model, n.name)]
    prototypes = [model.node(n.name).prototypes for n in model.spec.nodes]
    expert_params = [p for n in model.spec.nodes for p in model.node(n.name).experts.parameters()]
    opt = adam(
        [
            {"params": prototypes, "lr": settings.prototype_lr or settings.lr},
            {"params": expert_params, "lr": settings.lr},
        ],
        lr=settings.lr,
    )
    for epoch in range(settings.soft_epochs):
        loss = _epoch(model, model.forward, x, y, opt, settings.batch_size, generator)
        history.soft_losses.append(loss)
        if on_epoch is not None:
            on_epoch("soft", epoch, loss)
        if settings.refit_every and internal and (epoch + 1) % settings.refit_every == 0:
            refit_prototypes(model, sample, nodes=internal,
                                 seed=(settings.seed + epoch) % (MAX_SEED + 1))
            history.refits += 1
    model.harden(settings.routing, seed=settings.seed)
    opt = adam(expert_params, lr=settings.lr)

    for epoch in range(settings.hard_epochs):
        loss = _epoch(model, model.forward_routed, x, y, opt, settings.batch_size, generator)
        history.hard_losses.append(loss)
        if on_epoch is not None:
            on_epoch("hard", epoch, loss)
    model.eval()
    return history


def _epoch(
    model: nn.Module,
    forward: Callable[[Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    opt: torch.optim.Optimizer,
    batch_size: int,
    generator: torch.Generator,
) -> float:
    model.train()
    order = torch.randperm(x.shape[0], generator=generator).to(x.device)
    total = 0.0
    for begin in range(0, x.shape[0], batch_size):
        idx = order[begin : begin + batch_size]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(forward(x[idx]), y[idx])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        total += float(loss.detach()) * idx.numel()
    return total / max(x.shape[0], 1)


def train_nodewise(
    model: CompositionalMoMLP,
    x: Tensor,
    targets: Mapping[str, Tensor],
    settings: GraphTraining,
) -> None:
    """Algorithm 2 per node on observed targets; leaves `model` hardened, in eval.

    targets[v] [N, out_v] for every node v. A node's inputs are x's columns and its upstream
    nodes' *targets*, so nodes do not depend on each other's training and could run in
    parallel (here they run one after another).
    """
    missing = [n.name for n in model.spec.nodes if n.name not in targets]
    if missing:
        from ._exceptions import GraphSpecError

        raise GraphSpecError("nodewise training needs a target for every node", node=missing[0])
    for node_spec in model.spec.nodes:
        node = model.node(node_spec.name)
        z = model.node_inputs(node_spec.name, x, targets)
        _train_node(node, z, targets[node_spec.name], settings)
        node.harden(settings.routing, seed=settings.seed)
    model.eval()


def _train_node(node: NodeMixture, z: Tensor, y: Tensor, settings: GraphTraining) -> None:
    """One Algorithm 2 run: joint eq.-(39) phase of small networks and prototypes, deepen,
    then each expert trained on its own cell on standardised targets (as trainer's build)."""
    generator = torch.Generator().manual_seed(settings.seed)
    widths = node.spec.widths
    hidden = widths[1:-1]
    # Deepening adds layers of the last hidden width, so it rebuilds `widths` only when all
    # hidden widths are equal; otherwise the small networks already have the full arch.
    deepens = len(hidden) > 1 and len(set(hidden)) == 1
    small_arch = ExpertArch(widths=(widths[0], hidden[0], widths[-1]) if deepens else widths)
    smalls = [ExpertMLP(small_arch, generator=generator) for _ in range(node.num_experts)]
    mean, std = target_scaling(y)
    scaled = (y - mean) / std
    if node.num_experts > 1:
        prototypes = learned_prototypes(
            z, scaled, smalls, loss_fn=nn.functional.mse_loss, epochs=settings.prototype_epochs,
            lr=settings.lr, prototype_lr=settings.prototype_lr or settings.lr,
            batch_size=settings.batch_size, generator=generator,
        )
        with torch.no_grad():
            node.prototypes.copy_(prototypes)
        tree = node_tree(prototypes, node.spec.branching, settings.seed)
        cells = tree.route(z.detach(), mode=settings.routing).experts[:, 0]
    else:
        cells = torch.zeros(z.shape[0], dtype=torch.long)
    for k, small in enumerate(smalls):
        rows = torch.nonzero(cells == k).flatten()
        cy = y[rows]
        c_mean, c_std = target_scaling(cy)
        # Each expert trains on its own cell's standardised targets, served on the raw scale.
        expert = small.deepen(len(hidden) - 1, generator=generator) if deepens else small
        rescale_output(expert, std / c_std, (mean - c_mean) / c_std)
        train_network(
            expert, z[rows], (cy - c_mean) / c_std, loss_fn=nn.functional.mse_loss,
            epochs=settings.expert_epochs, lr=settings.lr, batch_size=settings.batch_size,
            generator=generator,
        )
        rescale_output(expert, c_std, c_mean)
        node.experts[k].load_state_dict(expert.state_dict())
