"""Per-node fine-tune of a hardened CompositionalMoMLP, the rest of the graph frozen.

The objective is the graph's own training loss, MSE(forward_routed(x), y), with only node
v's experts free: every prototype (hence every route upstream of v and v's own) and every
other node's experts stay as they are. For the output node that is its true target; for an
internal node it is the observed target seen through the frozen downstream nodes (their
routes recomputed on v's new outputs, as serving would), so no invented per-node target is
needed. Each node is one job (one Ray task, or in-process with the local executor): Adam
for `epochs` epochs, keeping the best state by the full training loss, its starting state
included, so a job never raises the loss it optimises.

The jobs all start from the same graph, so their updates are block-coordinate steps taken
in parallel; together they can interfere. The driver applies them all when that lowers the
training loss, and otherwise one by one (largest own gain first), keeping each only if the
joint loss goes down: the fine-tune never raises the training loss.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from .._executors import ray_runtime
from .._train import adam
from ._model import CompositionalMoMLP

__all__ = [
    "FinetuneOptions", "FinetuneReport", "finetune_node_job", "finetune_nodes", "training_loss",
]

logger = logging.getLogger(__name__)

NodeState = dict[str, np.ndarray[Any, Any]]


@dataclass
class FinetuneReport:
    before: float  # training loss before the fine-tune
    after: float  # ... and after (≤ before)
    node_losses: dict[str, tuple[float, float]] = field(default_factory=dict)  # own job
    kept: list[str] = field(default_factory=list)  # nodes whose update was applied


@torch.no_grad()
def training_loss(model: CompositionalMoMLP, x: Tensor, y: Tensor) -> float:
    """The loss the hard phase and the fine-tune optimise: MSE of forward_routed."""
    return float(nn.functional.mse_loss(model.forward_routed(x), y))


def _node_state(model: CompositionalMoMLP, name: str) -> NodeState:
    return {k: v.detach().cpu().numpy().copy()
            for k, v in model.node(name).experts.state_dict().items()}


def _load_node_state(model: CompositionalMoMLP, name: str, state: NodeState) -> None:
    model.node(name).experts.load_state_dict({k: torch.tensor(v) for k, v in state.items()})


@dataclass(frozen=True)
class FinetuneOptions:
    epochs: int
    lr: float
    batch_size: int


def finetune_node_job(
    model: CompositionalMoMLP, name: str, x: Tensor, y: Tensor, options: FinetuneOptions,
    seed: int,
) -> dict[str, Any]:
    """Fine-tune node `name`'s experts (only) on the graph's training loss; one thread, so
    a Ray worker and the driver compute the same floats. Returns the best state seen and
    the loss before and after. Mutates `model` (a task's own copy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for param in model.parameters():
            param.requires_grad_(False)
        params = list(model.node(name).experts.parameters())
        for param in params:
            param.requires_grad_(True)
        generator = torch.Generator().manual_seed(seed)
        opt = adam(params, lr=options.lr)
        before = best = training_loss(model, x, y)
        best_state = _node_state(model, name)
        for _ in range(options.epochs):
            order = torch.randperm(x.shape[0], generator=generator)
            for begin in range(0, x.shape[0], options.batch_size):
                idx = order[begin : begin + options.batch_size]
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model.forward_routed(x[idx]), y[idx])
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
            current = training_loss(model, x, y)
            if current < best:
                best, best_state = current, _node_state(model, name)
        return {"node": name, "before": before, "after": best, "state": best_state}
    finally:
        torch.set_num_threads(threads)


def _run_jobs(
    model: CompositionalMoMLP, x: Tensor, y: Tensor, jobs: list[tuple[str, int]],
    options: FinetuneOptions, executor: Literal["ray", "local"],
    ray_address: str | None, num_cpus: int | None,
) -> list[dict[str, Any]]:
    if executor == "local":
        return [finetune_node_job(copy.deepcopy(model), name, x, y, options, seed)
                for name, seed in jobs]
    import ray

    with ray_runtime(ray_address, num_cpus):
        remote = ray.remote(finetune_node_job).options(num_cpus=1, max_retries=1)
        # One copy of the (small) model and the rows in the object store, shared by all tasks.
        model_ref, x_ref, y_ref = ray.put(model), ray.put(x), ray.put(y)
        futures = [remote.remote(model_ref, name, x_ref, y_ref, options, seed)
                   for name, seed in jobs]
        results: list[dict[str, Any]] = ray.get(futures)
    return results


def finetune_nodes(
    model: CompositionalMoMLP,
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    executor: Literal["ray", "local"] = "ray",
    ray_address: str | None = None,
    num_cpus: int | None = None,
) -> FinetuneReport:
    """One fine-tune job per node with K_v ≥ 1 experts, then the driver's merge (module
    doc). `model` must be hardened; it is updated in place and left in eval."""
    if not model.hardened:
        from ._exceptions import NotHardened

        raise NotHardened()
    model.eval()
    before = training_loss(model, x, y)
    jobs = [(n.name, seed + i) for i, n in enumerate(model.spec.nodes)]
    options = FinetuneOptions(epochs, lr, batch_size)
    results = _run_jobs(model, x, y, jobs, options, executor, ray_address, num_cpus)
    report = FinetuneReport(before=before, after=before, node_losses={
        r["node"]: (r["before"], r["after"]) for r in results
    })
    gains = sorted((r for r in results if r["after"] < r["before"]),
                   key=lambda r: (r["after"] - r["before"], r["node"]))
    old = {r["node"]: _node_state(model, r["node"]) for r in gains}
    for r in gains:
        _load_node_state(model, r["node"], r["state"])
    joint = training_loss(model, x, y)
    if joint < before:
        report.after, report.kept = joint, [r["node"] for r in gains]
    else:
        # Updates that interfere: back to the start, then add one at a time if it helps.
        for name, state in old.items():
            _load_node_state(model, name, state)
        for r in gains:
            _load_node_state(model, r["node"], r["state"])
            joint = training_loss(model, x, y)
            if joint < report.after:
                report.after = joint
                report.kept.append(r["node"])
            else:
                _load_node_state(model, r["node"], old[r["node"]])
    logger.info("graph fine-tune: training loss %.6g -> %.6g, kept %s",
                before, report.after, report.kept)
    return report
