"""Optional capabilities a kind may have beyond `ServedModel`, for the floors above to ask for.

The floors above ask for them with `patch_inputs`, `patch_routing`, `graph_layout`,
`expert_generator` and `condition_taker` (isinstance against these runtime-checkable
Protocols, remembered per class), so a kind that has them gets image bodies, per-patch routing
in responses, GET /v1/graph, POST /v1/generate and its budget check at start, or conditions
beside its rows, without those floors naming the kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from experts_store import GraphBlock
from server._settings import Settings
from server.kinds._types import ConditionRequest

__all__ = [
    "ConditionTaker", "ExpertGenerator", "GraphLayout", "PatchChoice", "PatchInputs",
    "PatchRowRouting", "condition_taker", "expert_generator", "graph_layout", "patch_inputs",
    "patch_routing",
]  # fmt: skip


@dataclass(frozen=True)
class PatchChoice:
    """The patches (indices 0..n-1, in the order the expert took them) one expert took for
    one row, and each one's gate."""

    expert_id: int
    patches: list[int]
    gates: list[float]


@runtime_checkable
class PatchRowRouting(Protocol):
    """A row routing that knows, per row, which patches went to which expert."""

    @property
    def dense_patches(self) -> int:
        """Patch computations a dense mixture would make for these rows: rows·n·k."""
        ...

    def patch_choices(self) -> list[list[PatchChoice]]:
        """Per row, per expert that took any patch (in expert-id order), its choice."""
        ...


@runtime_checkable
class PatchInputs(Protocol):
    """A model whose inputs are patches: rows of n·d values, or images it cuts itself."""

    @property
    def image_shape(self) -> tuple[int, int, int] | None:
        """(H, W, C) of the images it takes, or None when it takes only flat rows."""
        ...

    def image_rows(self, images: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """[B, H, W, C] images as flat rows [B, n·d], patches in the order it was trained on."""
        ...


@runtime_checkable
class GraphLayout(Protocol):
    """A model that is a graph of mixtures: its nodes, edges and waves, and their cost."""

    @property
    def graph(self) -> GraphBlock: ...

    @property
    def max_distance_evals(self) -> int:
        """The most a row's tree walks through every node can cost."""
        ...


@runtime_checkable
class ExpertGenerator(Protocol):
    """A model whose experts are generated per condition (θ_I = f(I)), not read from files."""

    def condition_of(self, name: str) -> np.ndarray[Any, Any]:
        """A named condition's values (InvalidRequest when the store names none so)."""
        ...

    def check_condition(self, values: list[float] | None) -> np.ndarray[Any, Any]:
        """One condition's values as float32 (InvalidRequest: wrong length, not finite)."""
        ...

    def generate_file(
        self, condition: np.ndarray[Any, Any], tmp_dir: Path | None = None
    ) -> tuple[str, bytes]:
        """θ for `condition` as the bytes of a store expert file: (its cache key, the bytes)."""
        ...

    def check_budget(self, budget_bytes: int) -> None:
        """ExpertTooLarge when the generator (pinned on every actor) and one generated expert
        beside it cannot fit `budget_bytes`."""
        ...


@runtime_checkable
class ConditionTaker(Protocol):
    """A model whose rows carry a condition I beside x: the batcher moves [x, I] rows."""

    def with_conditions(
        self, x: np.ndarray[Any, Any], request: ConditionRequest | None, settings: Settings
    ) -> np.ndarray[Any, Any]:
        """The rows it routes on from x [B, m1] and the request's conditions (InvalidRequest
        naming the field, CapExceeded past `max_conditions`)."""
        ...

    def check_attached(self, rows: np.ndarray[Any, Any], settings: Settings) -> None:
        """Rows that came as [x, I] already (the v2 protocol's input), checked as
        `with_conditions` checks a request's conditions."""
        ...


# isinstance against a runtime-checkable Protocol looks up each member on the object: ~6 µs,
# asked on every request. A kind's model and routing classes define their members on the
# class, so the answer is one per class.
_CONFORMS: dict[tuple[type, type], bool] = {}


def _conforms(obj: object, protocol: type) -> bool:
    key = (type(obj), protocol)
    known = _CONFORMS.get(key)
    if known is None:
        known = _CONFORMS[key] = isinstance(obj, protocol)
    return known


def patch_inputs(model: object) -> PatchInputs | None:
    """`model` as a `PatchInputs` when its kind takes patches, else None."""
    return model if _conforms(model, PatchInputs) else None  # type: ignore[return-value]


def patch_routing(routing: object) -> PatchRowRouting | None:
    """`routing` as a `PatchRowRouting` when it knows each row's patches, else None."""
    return routing if _conforms(routing, PatchRowRouting) else None  # type: ignore[return-value]


def graph_layout(model: object) -> GraphLayout | None:
    """`model` as a `GraphLayout` when its kind is a graph of mixtures, else None."""
    return model if _conforms(model, GraphLayout) else None  # type: ignore[return-value]


def expert_generator(model: object) -> ExpertGenerator | None:
    """`model` as an `ExpertGenerator` when its kind generates its experts, else None."""
    return model if _conforms(model, ExpertGenerator) else None  # type: ignore[return-value]


def condition_taker(model: object) -> ConditionTaker | None:
    """`model` as a `ConditionTaker` when its rows carry conditions, else None."""
    return model if _conforms(model, ConditionTaker) else None  # type: ignore[return-value]
