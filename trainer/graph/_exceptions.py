"""Errors of the compositional (graph) trainer; a branch of the trainer's tree.

    TrainerError                  (trainer._exceptions)
     └── GraphError
          ├── GraphSpecError      a graph refused before any training; `node` names where
          │    ├── GraphCycle         the nodes form a cycle
          │    ├── UndefinedInput     an input names no input coordinate and no node
          │    ├── ArityMismatch      the inputs' total width differs from the expert input dim
          │    ├── MissingOutput      the graph's output names no node (or none is given)
          │    ├── OutputWidthMismatch the outputs are not as wide as y (nodewise: t_<node>)
          │    └── TooManyExperts     a node has more experts than rows to fit them on
          └── NotHardened         forward_hard / routing asked of a model before harden()
"""

from __future__ import annotations

from .._exceptions import TrainerError

__all__ = [
    "ArityMismatch",
    "GraphCycle",
    "GraphError",
    "GraphSpecError",
    "MissingOutput",
    "NotHardened",
    "OutputWidthMismatch",
    "TooManyExperts",
    "UndefinedInput",
]


class GraphError(TrainerError):
    """Base of every error `trainer.graph` raises on purpose."""


class GraphSpecError(GraphError):
    """The spec cannot be trained; `node` names the node at fault ("" for the graph itself)."""

    def __init__(self, message: str, *, node: str) -> None:
        where = f"node {node!r}" if node else "graph"
        super().__init__(f"{where}: {message}", node=node)
        self.node = node


class GraphCycle(GraphSpecError):
    def __init__(self, *, node: str, cycle: tuple[str, ...]) -> None:
        super().__init__(f"is on a cycle {' -> '.join(cycle)}", node=node)
        self.cycle = cycle


class UndefinedInput(GraphSpecError):
    def __init__(self, *, node: str, ref: str) -> None:
        super().__init__(f"input {ref!r} is neither an input coordinate nor a node", node=node)
        self.ref = ref


class ArityMismatch(GraphSpecError):
    def __init__(self, *, node: str, arity: int, expert_input_dim: int) -> None:
        super().__init__(
            f"its inputs are {arity} wide but its experts take {expert_input_dim}", node=node
        )
        self.arity = arity
        self.expert_input_dim = expert_input_dim


class MissingOutput(GraphSpecError):
    def __init__(self, *, node: str) -> None:
        message = "names no output node" if not node else "is named as output but not defined"
        super().__init__(message, node=node)


class OutputWidthMismatch(GraphSpecError):
    """The graph's outputs (node "" when several) or a node's output are `width` columns wide
    but their `target` ("y", or "t_<node>" when nodewise) has `columns`."""

    def __init__(
        self, *, node: str, outputs: tuple[str, ...], width: int, target: str, columns: int
    ) -> None:
        what = "its output is" if node else f"the outputs {', '.join(outputs)} are"
        super().__init__(
            f"{what} {_columns(width)} wide but {target} has {_columns(columns)}", node=node
        )
        self.outputs = outputs
        self.width = width
        self.target = target
        self.columns = columns


class TooManyExperts(GraphSpecError):
    def __init__(self, *, node: str, experts: int, rows: int) -> None:
        super().__init__(
            f"has {experts} experts but its prototypes are fitted on only {rows} training "
            "rows; give it at most that many experts (or more data)", node=node,
        )
        self.experts = experts
        self.rows = rows


def _columns(count: int) -> str:
    return f"{count} column" if count == 1 else f"{count} columns"


class NotHardened(GraphError):
    def __init__(self) -> None:
        super().__init__("the model has soft gates; call harden() first")
