"""Kind "hyper"'s conditions: the store's table of named conditions, and the checks a
request's conditions pass before they join its rows as [x, I] (`server.kinds._hyper`).

A request gives one condition per row (`conditions`), one for every row (`condition`) or
names from the table (`condition_ids`); each is refused naming its field (422). Each distinct
condition costs a θ generation, so their number per request is capped (`max_conditions`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from experts_store import HyperSpec
from server._exceptions import CapExceeded, InvalidRequest
from server._settings import Settings
from server.kinds._types import ConditionRequest

__all__ = ["HyperConditions"]


class HyperConditions:
    """A hyper store's named conditions (its table, when it has one) and how a request's
    conditions become the I of its [x, I] rows."""

    def __init__(
        self,
        spec: HyperSpec,
        table: torch.Tensor | None,
        ids: Sequence[str],
        *,
        from_prototypes: bool,
    ) -> None:
        """`from_prototypes`: the store routes each row to its nearest prototype, whose row
        of the table is its condition; requests bring x alone."""
        self._input_dim = spec.input_dim
        self._dim = spec.condition_dim
        self._table = table
        self._ids = {name: i for i, name in enumerate(ids)}
        self._from_prototypes = from_prototypes

    @property
    def from_requests(self) -> bool:
        """Whether requests bring the rows' conditions (else the prototypes give them)."""
        return not self._from_prototypes

    @property
    def names(self) -> list[str]:
        """The names of the table's rows, in table order."""
        return list(self._ids)

    def attach(
        self, x: np.ndarray, request: ConditionRequest | None, settings: Settings
    ) -> np.ndarray:
        """[x, I] rows from x [B, m1] and the request's conditions (422 naming the field)."""
        field = request.given if request is not None else None
        if self._from_prototypes:
            if field is not None:
                raise InvalidRequest(
                    f"this store routes each row to its nearest prototype; it takes no {field}",
                    field=field,
                )
            return x
        if request is None or field is None:
            raise InvalidRequest(
                "a hyper store needs conditions (one per row), condition (one for all rows) "
                "or condition_ids, in a JSON body",
                field="conditions",
            )
        rows = x.shape[0]
        if request.conditions is not None:
            values = self._rows(request.conditions, rows, "conditions")
        elif request.condition is not None:
            values = self._rows([request.condition], 1, "condition")
            values = np.repeat(values, rows, axis=0)
        else:
            assert request.condition_ids is not None
            values = self._named(request.condition_ids, rows)
        _check_distinct(values, field, settings)
        assert values.shape == (rows, self._dim)
        return np.ascontiguousarray(np.concatenate([x, values], axis=1), dtype=np.float32)

    def check_attached(self, rows: np.ndarray, settings: Settings) -> None:
        """Rows that came as [x, I] already (the v2 protocol's input): the same cap on
        distinct conditions as `attach`, since each one costs a θ generation."""
        if not self._from_prototypes:
            _check_distinct(rows[:, self._input_dim :], "input", settings)

    def named(self, name: str) -> np.ndarray:
        """A named condition's values (422 `condition_id` when the table lacks it)."""
        if name not in self._ids or self._table is None:
            raise InvalidRequest(f"unknown condition id {name!r}", field="condition_id")
        return self._table[self._ids[name]].numpy()

    def checked(self, values: list[float] | None) -> np.ndarray:
        """One condition's values as float32 (422 `condition`: wrong length, not finite)."""
        row: np.ndarray = self._rows([values or []], 1, "condition")[0]
        return row

    def _rows(self, values: list[list[float]], rows: int, field: str) -> np.ndarray:
        if len(values) != rows:
            raise InvalidRequest(f"{field} has {len(values)} entries for {rows} rows",
                                 field=field)
        m2 = self._dim
        bad = next((i for i, row in enumerate(values) if len(row) != m2), None)
        if bad is not None:
            raise InvalidRequest(
                f"{field}[{bad}] has {len(values[bad])} values, the store's conditions have {m2}",
                field=field,
            )
        with np.errstate(over="ignore", invalid="ignore"):
            array = np.asarray(values, dtype=np.float32).reshape(rows, m2)
        if not bool(np.isfinite(array).all()):
            raise InvalidRequest(f"{field} must be finite float32 numbers", field=field)
        return array

    def _named(self, names: list[str], rows: int) -> np.ndarray:
        if len(names) not in (1, rows):
            raise InvalidRequest(
                f"condition_ids has {len(names)} entries for {rows} rows (give 1 or {rows})",
                field="condition_ids",
            )
        unknown = sorted({n for n in names if n not in self._ids})
        if unknown or self._table is None:
            raise InvalidRequest(
                f"unknown condition ids {unknown[:5]}; the store names {len(self._ids)}",
                field="condition_ids",
            )
        index = [self._ids[n] for n in names] * (rows if len(names) == 1 else 1)
        values: np.ndarray = self._table[index].numpy()
        return values


def _check_distinct(values: np.ndarray, field: str, settings: Settings) -> None:
    distinct = int(np.unique(values, axis=0).shape[0])
    if distinct > settings.max_conditions:
        raise CapExceeded(
            cap="max_conditions", limit=settings.max_conditions, value=distinct, field=field
        )
