"""Compositional MoMLP (seed 004): a DAG of small mixtures, each routed in its own input space.

    from trainer.graph import binary_tree_spec, CompositionalMoMLP, GraphTraining, train_end_to_end
    spec = binary_tree_spec(8, experts=4, hidden=(8, 8))      # or GraphSpec.from_dict(json)
    validate(spec, input_dim=8)                                # GraphSpecError names the node
    model = CompositionalMoMLP(spec, input_dim=8, seed=0)
    train_end_to_end(model, x, y, GraphTraining())             # soft gates, refits, harden, hard
    hard = model.forward_hard(x)   # hard.outputs; hard.experts["root"]: expert used per row

Per node v, in `waves(spec)` order: z = model.node_inputs(v, x, values);
k = model.node(v).route(z); values[v] = model.node(v).run(z, k).
"""

from __future__ import annotations

from ._data import read_graph_npz
from ._exceptions import (
    ArityMismatch,
    GraphCycle,
    GraphError,
    GraphSpecError,
    MissingOutput,
    NotHardened,
    OutputWidthMismatch,
    TooManyExperts,
    UndefinedInput,
)
from ._finetune import FinetuneReport, finetune_nodes, training_loss
from ._model import CompositionalMoMLP, HardForward, NodeMixture
from ._publish import (
    GRAPH_DATASETS,
    GraphBuildConfig,
    build_graph_store,
    graph_dataset,
    load_graph_spec,
    publish_graph,
    tree_target,
)
from ._spec import GraphSpec, InputRef, NodeSpec, binary_tree_spec, parse_ref, validate, waves
from ._train import (
    GraphHistory,
    GraphTraining,
    refit_prototypes,
    train_end_to_end,
    train_nodewise,
)

__all__ = [
    "GRAPH_DATASETS",
    "GraphBuildConfig",
    "build_graph_store",
    "read_graph_npz",
    "graph_dataset",
    "load_graph_spec",
    "publish_graph",
    "tree_target",
    "FinetuneReport",
    "finetune_nodes",
    "training_loss",
    "ArityMismatch",
    "CompositionalMoMLP",
    "GraphCycle",
    "GraphError",
    "GraphHistory",
    "GraphSpec",
    "GraphSpecError",
    "GraphTraining",
    "HardForward",
    "InputRef",
    "MissingOutput",
    "NodeMixture",
    "NodeSpec",
    "NotHardened",
    "OutputWidthMismatch",
    "TooManyExperts",
    "UndefinedInput",
    "binary_tree_spec",
    "parse_ref",
    "refit_prototypes",
    "train_end_to_end",
    "train_nodewise",
    "validate",
    "waves",
]
