"""The kinds floor: one planner/combiner pair per store kind, and the registry of kinds.

It sits on the pool floor (`server.pool`): a kind turns a batch's rows into groups of
(cache key, rows, gate weight), and the pool's answers back into outputs in input order.
The batching floor above calls a kind through `ServedModel`, never by its name.
"""

from __future__ import annotations

from server.kinds._conditions import (
    attach_conditions,
    check_attached_conditions,
    check_kind_budget,
)
from server.kinds._graph import GraphModel, GraphOptions, GraphRouting
from server.kinds._hyper import HyperModel, HyperOptions, HyperRouting
from server.kinds._momlp import GateRouter, MomlpModel
from server.kinds._pmoe import PatchModel, PatchOptions, PatchRouting
from server.kinds._registry import KINDS, open_model
from server.kinds._types import (
    GATE_OPTIONS,
    REQUEST_OPTIONS,
    BatchRun,
    ConditionRequest,
    GateRequest,
    HyperSection,
    ModelMismatch,
    ModelSection,
    Plan,
    PlannedGroup,
    RowRouting,
    ServedModel,
)
from server.kinds._views import (
    ConditionTaker,
    ExpertGenerator,
    GraphLayout,
    PatchChoice,
    PatchInputs,
    PatchRowRouting,
    condition_taker,
    expert_generator,
    graph_layout,
    patch_inputs,
    patch_routing,
)

__all__ = [
    "GATE_OPTIONS",
    "REQUEST_OPTIONS",
    "KINDS",
    "BatchRun",
    "ConditionRequest",
    "ConditionTaker",
    "ExpertGenerator",
    "HyperModel",
    "HyperOptions",
    "HyperRouting",
    "HyperSection",
    "attach_conditions",
    "check_attached_conditions",
    "check_kind_budget",
    "GateRequest",
    "GateRouter",
    "GraphModel",
    "GraphOptions",
    "GraphLayout",
    "GraphRouting",
    "ModelMismatch",
    "ModelSection",
    "MomlpModel",
    "PatchChoice",
    "PatchInputs",
    "PatchModel",
    "PatchOptions",
    "PatchRouting",
    "PatchRowRouting",
    "Plan",
    "PlannedGroup",
    "RowRouting",
    "ServedModel",
    "condition_taker",
    "expert_generator",
    "graph_layout",
    "open_model",
    "patch_inputs",
    "patch_routing",
]
