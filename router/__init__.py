"""router: the prototype tree that sends each input to its expert.

    from router import PrototypeTree
    tree = PrototypeTree.build(prototypes, branching=4, seed=0)
    r = tree.route(x, mode="tree", top_k=1)   # r.experts, r.weights, r.distances, r.distance_evals
    tree.save(path); PrototypeTree.load(path)
"""

from __future__ import annotations

from ._bruteforce import BruteForceRouter
from ._exceptions import (
    BadGate,
    BadMode,
    BadTopK,
    DimensionMismatch,
    EmptyBatch,
    InputOutOfRange,
    NonFiniteInput,
    RouterBuildError,
    RouterError,
    RouterFileError,
    RouterInputError,
)
from ._gate import Gate, GateRouting, Score, check_gate
from ._lift import (
    LIFT_EXTRA_DIMS,
    lift_rows,
    lifted_temperature,
    linear_lift,
    linear_logits,
    unlift,
)
from ._linear_search import LinearGateRouter
from ._routing import Mode, Routing
from ._tree import PrototypeTree

__all__ = [
    "LIFT_EXTRA_DIMS",
    "BadGate",
    "BadMode",
    "BadTopK",
    "BruteForceRouter",
    "DimensionMismatch",
    "EmptyBatch",
    "Gate",
    "GateRouting",
    "InputOutOfRange",
    "LinearGateRouter",
    "Mode",
    "NonFiniteInput",
    "PrototypeTree",
    "RouterBuildError",
    "RouterError",
    "RouterFileError",
    "RouterInputError",
    "Routing",
    "Score",
    "check_gate",
    "lift_rows",
    "lifted_temperature",
    "linear_lift",
    "linear_logits",
    "unlift",
]
