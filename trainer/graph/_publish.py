"""Publishing a trained CompositionalMoMLP as a store of kind "graph", and `momlp build
--kind graph`.

Each node's experts become ordinary manifest experts with global ids (the nodes in spec
order, each node's K_v experts in its prototype order), each node's prototype tree its own
content-named router file, and the DAG the manifest's `graph` block. The options, the data
file (`read_graph_npz`) and the spec (`validate`, then against the data: outputs as wide as
y, no node with more experts than training rows; naming the node) are checked before any
training or writing; the writer validates the block again against the experts' archs before
anything is published.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from experts_store import (
    ExpertMLP,
    GraphBlock,
    GraphNodeEntry,
    Manifest,
    StoreWriter,
    progress_bar,
)

from .._arrays import open_regular
from .._exceptions import ConfigError, DataError
from ._data import read_graph_npz
from ._exceptions import GraphSpecError, OutputWidthMismatch, TooManyExperts
from ._finetune import finetune_nodes
from ._model import CompositionalMoMLP
from ._spec import GraphSpec, binary_tree_spec, output_width, validate
from ._train import MAX_SEED, GraphTraining, train_end_to_end, train_nodewise

__all__ = [
    "GRAPH_DATASETS",
    "GraphBuildConfig",
    "build_graph_store",
    "graph_dataset",
    "load_graph_spec",
    "publish_graph",
    "tree_target",
]

# A spec names a few nodes: a file larger than this is not one (and is not read whole).
_MAX_SPEC_BYTES = 1 << 20

GRAPH_DATASETS = ("tree8", "tree16")
MIN_SAMPLES, MAX_SAMPLES = 16, 10_000_000  # rows of tree8/tree16 (caps the build's memory)
MAX_FINETUNE_EPOCHS = 10_000


@dataclass(frozen=True)
class GraphBuildConfig:
    out: Path
    spec: GraphSpec | None = None  # None: the binary tree of the dataset (tree8 / tree16)
    dataset: str | None = None
    data: Path | None = None
    training: Literal["end-to-end", "nodewise"] = "end-to-end"
    samples: int = 4000
    test_fraction: float = 0.2
    settings: GraphTraining = field(default_factory=GraphTraining)
    # Where the per-node fine-tune's jobs run (settings.finetune_epochs > 0 only).
    executor: Literal["ray", "local"] = "ray"
    ray_address: str | None = None
    num_cpus: int | None = None


def tree_target(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The seed-004 target h(a, b) = tanh(2ab + a - b) up a binary tree, with every node's
    value under the names of `binary_tree_spec` (the per-node targets nodewise needs)."""
    spec = binary_tree_spec(x.shape[1], experts=1, hidden=(1,))
    values: dict[str, torch.Tensor] = {}
    for node in spec.nodes:
        a, b = (x[:, int(r[2:])] if r.startswith("x:") else values[r][:, 0]
                for r in node.inputs)
        values[node.name] = torch.tanh(2 * a * b + a - b)[:, None]
    return values["root"], values


def graph_dataset(
    name: str, samples: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """tree8 / tree16: x ~ U[-1, 1]^d and the binary-tree target (with per-node targets)."""
    if name not in GRAPH_DATASETS:
        raise DataError(f"unknown graph dataset; choose one of {GRAPH_DATASETS}", source=name)
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(samples, int(name[4:]), generator=generator) * 2 - 1
    y, nodes = tree_target(x)
    return x, y, nodes


def load_graph_spec(path: Path) -> GraphSpec:
    """A spec JSON file (GraphSpec.from_dict); DataError if unreadable, GraphSpecError if
    malformed."""
    try:
        with open_regular(path) as handle:
            raw = handle.read(_MAX_SPEC_BYTES + 1)
        if len(raw) > _MAX_SPEC_BYTES:
            raise DataError(f"a graph spec is at most {_MAX_SPEC_BYTES} bytes",
                            source=str(path))
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON
        raise DataError(f"cannot read the graph spec: {exc}", source=str(path)) from exc
    except RecursionError:
        raise DataError("cannot read the graph spec: JSON nested too deeply",
                        source=str(path)) from None
    return GraphSpec.from_dict(data)


def publish_graph(
    model: CompositionalMoMLP,
    out: Path,
    *,
    report: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write a hardened model as a store of kind "graph" (atomic, like every publish)."""
    if not model.hardened:
        from ._exceptions import NotHardened

        raise NotHardened()
    routing = model.node(model.spec.nodes[0].name).routing
    with StoreWriter(out) as writer, tempfile.TemporaryDirectory() as tmp:
        entries: list[GraphNodeEntry] = []
        next_id = 0
        for spec in model.spec.nodes:
            node = model.node(spec.name)
            ids = list(range(next_id, next_id + node.num_experts))
            for expert_id, expert in zip(ids, node.experts, strict=True):
                assert isinstance(expert, ExpertMLP)
                writer.add_expert(expert_id, expert)
            next_id += node.num_experts
            assert node.tree is not None
            path = Path(tmp) / f"{spec.name}.safetensors"
            node.tree.save(path)
            entries.append(GraphNodeEntry(
                name=spec.name, inputs=list(spec.inputs), output_dim=spec.output_dim,
                branching=spec.branching, router_file=writer.stage_router(path), experts=ids,
            ))
        if report is not None:
            writer.write_report(report)
        output_dim = int(model.gather_outputs(
            torch.zeros(1, model.input_dim),
            {n.name: torch.zeros(1, n.output_dim) for n in model.spec.nodes},
        ).shape[1])
        return writer.publish(
            task="regression", input_dim=model.input_dim, output_dim=output_dim,
            routing=routing, branching=max(n.branching for n in model.spec.nodes),
            extra=extra, kind="graph",
            graph=GraphBlock(nodes=entries, outputs=list(model.spec.outputs)),
        )


class _EpochBar:
    """The build's progress bar: epochs (or nodes) done, the phase and its latest loss."""

    def __init__(self, total: int, enabled: bool, unit: str) -> None:
        self._bar = progress_bar(total, "graph", unit, enabled=enabled)

    def epoch(self, phase: str, epoch: int, loss: float) -> None:
        self._bar.set_postfix(phase=phase, loss=f"{loss:.4g}")
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def build_graph_store(config: GraphBuildConfig, progress: bool = True) -> Manifest:
    """Load the data, validate the graph (naming the node) before training, train it end
    to end or node by node, evaluate on a held-out split and publish `config.out`."""
    started = time.perf_counter()
    settings = config.settings
    _check_config(config)
    if config.dataset is not None:
        x, y, targets = graph_dataset(config.dataset, config.samples, settings.seed)
    else:
        assert config.data is not None
        x, y, targets = read_graph_npz(config.data)
    spec = config.spec
    if spec is None:
        if config.dataset is None:
            raise ConfigError("a graph build from --data needs --graph spec.json", option="graph")
        spec = binary_tree_spec(x.shape[1], experts=4, hidden=(8, 8))
    validate(spec, x.shape[1])
    test = max(1, int(x.shape[0] * config.test_fraction))
    if test >= x.shape[0]:
        rows = f"{x.shape[0]} row" + ("" if x.shape[0] == 1 else "s")
        raise DataError(
            f"has {rows}; holding out the test fraction {config.test_fraction} (at least one "
            "row) leaves none to train on", source=config.dataset or str(config.data),
        )
    _check_fit(spec, config, y, targets, train_rows=x.shape[0] - test)
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(settings.seed))
    train_rows, test_rows = order[test:], order[:test]
    model = CompositionalMoMLP(spec, x.shape[1], seed=settings.seed)
    if config.training == "nodewise":
        bar = _EpochBar(1, progress, "run")
        train_nodewise(model, x[train_rows], {k: v[train_rows] for k, v in targets.items()},
                       settings)
        bar.epoch("nodewise", 0, float("nan"))
    else:
        bar = _EpochBar(settings.soft_epochs + settings.hard_epochs, progress, "epoch")
        train_end_to_end(model, x[train_rows], y[train_rows], settings, on_epoch=bar.epoch)
    bar.close()
    finetune = _finetune(model, config, x[train_rows], y[train_rows], x[test_rows],
                         y[test_rows]) if settings.finetune_epochs > 0 else None
    mse = _test_mse(model, x[test_rows], y[test_rows])
    report = {
        "kind": "graph",
        "training": config.training,
        "source": config.dataset or str(config.data),
        "rows": {"train": int(train_rows.numel()), "test": int(test_rows.numel())},
        "mixture": {"metric": "mse", "value": mse, "params": model.total_parameters(),
                    "active_params": model.active_parameters()},
        "target_variance": float(y[test_rows].var()),
        "spec": spec.to_dict(),
        "timings": {"total_s": time.perf_counter() - started},
    }
    if finetune is not None:
        report["finetune"] = finetune
    return publish_graph(model, config.out, report=report)


def _check_config(config: GraphBuildConfig) -> None:
    """ConfigError naming the first option (as `momlp build` spells it) that cannot work."""
    settings = config.settings
    if (config.dataset is None) == (config.data is None):
        raise ConfigError("give exactly one of dataset and data", option="dataset")
    if not MIN_SAMPLES <= config.samples <= MAX_SAMPLES:
        raise ConfigError(f"must be in [{MIN_SAMPLES}, {MAX_SAMPLES}], got {config.samples}",
                          option="samples")
    if not 0.0 < config.test_fraction < 1.0:
        raise ConfigError(f"must lie in (0, 1), got {config.test_fraction}",
                          option="test_fraction")
    if not 0 <= settings.finetune_epochs <= MAX_FINETUNE_EPOCHS:
        raise ConfigError(f"must be in [0, {MAX_FINETUNE_EPOCHS}], got "
                          f"{settings.finetune_epochs}", option="graph_finetune_epochs")
    for option, rate in (("lr", settings.lr), ("prototype_lr", settings.prototype_lr)):
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ConfigError(f"must be a positive number, got {rate}", option=option)
    counts = {
        # --epochs sets the soft, hard and (nodewise) expert epochs alike.
        "epochs": min(settings.soft_epochs, settings.hard_epochs, settings.expert_epochs),
        "prototype_epochs": settings.prototype_epochs,
        "refit_every": settings.refit_every,
    }
    for option, count in counts.items():
        if count < 0:
            raise ConfigError(f"must not be negative, got {count}", option=option)
    for option, count in (("batch_size", settings.batch_size),
                          ("refit_sample", settings.refit_sample)):
        if count < 1:
            raise ConfigError(f"must be at least 1, got {count}", option=option)
    if not 0 <= settings.seed <= MAX_SEED:
        raise ConfigError(f"must be in [0, {MAX_SEED}], got {settings.seed}", option="seed")


def _check_fit(
    spec: GraphSpec, config: GraphBuildConfig, y: torch.Tensor,
    targets: Mapping[str, torch.Tensor], *, train_rows: int,
) -> None:
    """Refuse, naming the node, a valid spec that the data cannot train: outputs not as wide
    as y (or, nodewise, a node's output as its t_<node>), or more experts than rows."""
    width = output_width(spec)
    if width != y.shape[1]:
        single = spec.outputs[0].partition(":")[0] if len(spec.outputs) == 1 else ""
        raise OutputWidthMismatch(node=single, outputs=spec.outputs, width=width, target="y",
                                  columns=int(y.shape[1]))
    nodewise = config.training == "nodewise"
    if nodewise:
        missing = [n.name for n in spec.nodes if n.name not in targets]
        if missing:
            raise GraphSpecError("nodewise training needs a target for every node",
                                 node=missing[0])
        for node in spec.nodes:
            columns = int(targets[node.name].shape[1])
            if columns != node.output_dim:
                raise OutputWidthMismatch(node=node.name, outputs=(node.name,),
                                          width=node.output_dim, target=f"t_{node.name}",
                                          columns=columns)
    # A node's prototypes are fitted on rows of its inputs (end to end: k-means on a sample
    # of at most refit_sample training rows; nodewise: every training row), and k-means
    # cannot place more centroids than rows.
    rows = train_rows if nodewise else min(train_rows, config.settings.refit_sample)
    for node in spec.nodes:
        if node.experts > 1 and node.experts > rows:
            raise TooManyExperts(node=node.name, experts=node.experts, rows=rows)


def _test_mse(model: CompositionalMoMLP, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.mean((model.forward_hard(x).outputs - y) ** 2))


def _finetune(
    model: CompositionalMoMLP, config: GraphBuildConfig, x: torch.Tensor, y: torch.Tensor,
    x_test: torch.Tensor, y_test: torch.Tensor,
) -> dict[str, Any]:
    """The per-node fine-tune (one job per node), with the test MSE before and after."""
    settings = config.settings
    test_before = _test_mse(model, x_test, y_test)
    result = finetune_nodes(
        model, x, y, epochs=settings.finetune_epochs, lr=settings.lr,
        batch_size=settings.batch_size, seed=settings.seed, executor=config.executor,
        ray_address=config.ray_address, num_cpus=config.num_cpus,
    )
    return {
        "epochs": settings.finetune_epochs, "executor": config.executor,
        "train_loss": {"before": result.before, "after": result.after},
        "test_mse": {"before": test_before, "after": _test_mse(model, x_test, y_test)},
        "nodes": {k: {"before": b, "after": a} for k, (b, a) in result.node_losses.items()},
        "kept": result.kept,
    }
