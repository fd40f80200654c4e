"""The skeleton of a kind that serves a batch in one round: plan once, combine once."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from server.kinds._types import Plan, PlannedGroup
from server.pool import GroupResult

__all__ = ["OneRoundRun"]


class OneRoundRun(ABC):
    """A `BatchRun` whose groups all come in the first round (flat mixtures: momlp, hyper,
    pmoe). Subclasses say which groups (`_groups`) and how results become outputs
    (`_combine`, returning [B, out] float32 in input order)."""

    def __init__(self) -> None:
        self._planned = False
        self._out: torch.Tensor | None = None

    @abstractmethod
    def _groups(self) -> list[PlannedGroup]: ...

    @abstractmethod
    def _combine(self, plan: Plan, results: Sequence[GroupResult]) -> torch.Tensor: ...

    def plan(self) -> Plan | None:
        if self._planned:
            return None
        self._planned = True
        return Plan(self._groups())

    def combine(self, plan: Plan, results: Sequence[GroupResult]) -> None:
        self._out = self._combine(plan, results)

    @property
    def outputs(self) -> torch.Tensor:
        if self._out is None:
            raise RuntimeError("outputs asked before the round was combined")
        return self._out
