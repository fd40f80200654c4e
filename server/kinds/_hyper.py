"""Kind "hyper": a hypernetwork f generates, per condition I, the weights θ_I of a small
primary network g (paper 001); θ_I is cached on the actors like a loaded expert.

Rows: the HTTP floor appends each row's condition to its x (`with_conditions`, checked by
`server.kinds._hyper_conditions`), so the batcher moves [x, I] rows and merges requests of
different conditions into one batch.
Route: each distinct condition is a cache key, `condition_key(f's sha256, I's float32
bytes)`. Plan: one group per key, a `GeneratedRef` the actor's loader generates θ_I for on a
miss (f pinned there). Combine: each row takes its key's output as it is (weight 1), so a
row's output depends only on its x and its condition. POST /v1/generate's θ is made in the
server process (`server.kinds._hyper_generate`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experts_store import (
    ExpertLoadError,
    ExpertTooLarge,
    GeneratedRef,
    GeneratorRef,
    HyperSpec,
    Pace,
    Store,
    check_hypernetwork_file,
    condition_bytes,
    condition_key,
    load_conditions,
    no_pace,
    own_file_problem,
)
from server._exceptions import InvalidRequest
from server._settings import Settings
from server.kinds._hyper_conditions import HyperConditions
from server.kinds._hyper_generate import GENERATOR_ID, LocalGenerator
from server.kinds._one_round import OneRoundRun
from server.kinds._types import (
    ConditionRequest,
    GateRequest,
    HyperSection,
    ModelMismatch,
    ModelSection,
    Plan,
    PlannedGroup,
)
from server.pool import GroupResult

__all__ = ["HyperModel", "HyperOptions", "HyperRouting"]


@dataclass(frozen=True)
class HyperOptions:
    """A hyper store has no gate: every request merges with every other."""

    source: str = "request"


@dataclass(frozen=True)
class HyperRouting:
    """Each row's key (hex) and, when its condition is in the store's table, its index."""

    keys: tuple[str, ...]
    experts: torch.Tensor  # [B, 1] int64: the named condition's index, else -1
    conditions: torch.Tensor  # [B, m2] float32
    # [B, 1] float32: Euclidean distance to the prototype a prototype-conditioned store chose;
    # 0 where the request named its condition (nothing was measured).
    distances: torch.Tensor

    @property
    def rows(self) -> int:
        return len(self.keys)

    @property
    def weights(self) -> torch.Tensor:
        return (self.experts >= 0).to(torch.float64)

    @property
    def distance_evals(self) -> torch.Tensor:
        return torch.zeros(self.rows, dtype=torch.int64)

    def slice(self, start: int, stop: int) -> HyperRouting:
        return HyperRouting(
            self.keys[start:stop], self.experts[start:stop], self.conditions[start:stop],
            self.distances[start:stop],
        )

    @staticmethod
    def concat(parts: Sequence[HyperRouting]) -> HyperRouting:
        return HyperRouting(
            tuple(k for p in parts for k in p.keys),
            torch.cat([p.experts for p in parts]),
            torch.cat([p.conditions for p in parts]),
            torch.cat([p.distances for p in parts]),
        )


class HyperModel:
    """A store of kind "hyper": f's file, g's layout and the named conditions."""

    kind = "hyper"

    def __init__(
        self,
        spec: HyperSpec,
        generator: GeneratorRef,
        table: torch.Tensor | None = None,
        ids: Sequence[str] = (),
        router: Any = None,
    ) -> None:
        """`router` (a PrototypeTree over the table's rows): prototype-conditioned, each row
        served by g(·; f(p_k)) of its nearest prototype; None: requests name conditions."""
        self.spec = spec
        self.router = router
        self.generator = generator
        self.experts: list[Any] = []  # no expert files: θ is generated
        self._spec_json = spec.model_dump_json()
        self._table = table
        self._conditions = HyperConditions(spec, table, ids, from_prototypes=router is not None)
        self._table_keys: dict[str, int] = {}
        if table is not None:
            for i, row in enumerate(table):
                self._table_keys.setdefault(condition_key(generator.sha256, row), i)
        self._prototype_keys: list[str] | None = None
        self._local = LocalGenerator(generator, spec)

    @classmethod
    def open(cls, store: Store, pace: Pace = no_pace) -> HyperModel:
        """Read the manifest block and the conditions table (verified); f's header is checked
        against the block, its arrays stay a file until an actor pins it. A hyper store has
        no expert rows: nothing to pace. ValueError when its files do not fit together."""
        spec = store.manifest.hyper
        if spec is None:
            raise ModelMismatch("a store of kind 'hyper' without its hyper block")
        f = spec.hypernetwork
        generator = GeneratorRef(
            sha256=f.sha256,
            path=str(store.root / f.file),
            nbytes=4 * f.params,
            expert_id=GENERATOR_ID,
            file_bytes=f.bytes,
        )
        table: torch.Tensor | None = None
        ids: list[str] = []
        label = f"hypernetwork {f.file}"
        try:
            # f's header, not its arrays: an f no actor could pin would fail every request.
            check_hypernetwork_file(store.root / f.file, f.widths, expected_bytes=f.bytes)
            if spec.conditions is not None:
                label = f"conditions {spec.conditions.file}"
                table, ids = load_conditions(
                    store.root / spec.conditions.file,
                    spec.conditions.sha256,
                    shape=(spec.conditions.count, spec.condition_dim),
                    expected_bytes=spec.conditions.bytes,
                )
        except ExpertLoadError as exc:
            # These files are no experts: the message names the file, not "expert -1".
            raise ModelMismatch(own_file_problem(label, exc)) from exc
        router = None
        if spec.condition_source == "prototype":
            from router import PrototypeTree

            router = PrototypeTree.load(store.router_path)
            # Row k of the table is the condition of prototype k: the two must be one set.
            if table is None or not torch.equal(router.prototypes, table):
                raise ModelMismatch("the router's prototypes are not the conditions table's rows")
        return cls(spec, generator, table, ids, router)

    @property
    def input_dim(self) -> int:
        """The width of the rows the batcher moves: x then the condition (x alone when the
        store routes to its prototypes)."""
        if self.router is not None:
            return self.spec.input_dim
        return self.spec.input_dim + self.spec.condition_dim

    def prototypes(self) -> torch.Tensor | None:
        return self._table if self.router is not None else None

    @property
    def routable_experts(self) -> int:
        """The K prototypes of a prototype-conditioned store, each served by θ = f(p_k) with
        no file; else its expert files (none: requests bring their conditions)."""
        if self.router is not None and self._table is not None:
            return int(self._table.shape[0])
        return len(self.experts)

    @property
    def beam_levels(self) -> int:
        # The prototype tree's levels, as /openapi.json has always stated them; `resolve`
        # refuses any beam for this kind all the same (it has no gate).
        return max(1, int(self.router.depth)) if self.router is not None else 1

    @property
    def options_taken(self) -> frozenset[str]:
        # No gate; conditions only where requests bring them (not from the prototypes).
        return frozenset({"conditions"}) if self._conditions.from_requests else frozenset()

    def model_section(self) -> ModelSection:
        spec = self.spec
        return ModelSection(
            hyper=HyperSection(
                condition_dim=spec.condition_dim,
                theta_bytes=spec.theta_nbytes,
                generator_bytes=self.generator.nbytes,
                primary_widths=list(spec.primary.widths),
                condition_source=spec.condition_source,
                condition_ids=self.condition_ids[:1000],
            )
        )

    def check_budget(self, budget_bytes: int) -> None:
        """An actor must hold f (pinned) and at least one θ beside it."""
        need = self.generator.nbytes + self.spec.theta_nbytes
        if need > budget_bytes:
            raise ExpertTooLarge(expert_id=GENERATOR_ID, nbytes=need, budget_bytes=budget_bytes)

    def resolve(self, request: GateRequest, settings: Settings) -> HyperOptions:
        if request.top_k not in (None, 1):
            raise InvalidRequest("a hyper store serves one θ per row: top_k must be 1",
                                 field="top_k")
        for name in ("mode", "temperature", "min_weight", "top_p", "beam", "score"):
            if getattr(request, name) is not None:
                raise InvalidRequest(f"a hyper store has no gate: {name} does not apply",
                                     field=name if name == "mode" else "gate")
        return HyperOptions()

    def check(self, options: Hashable) -> None:
        if not isinstance(options, HyperOptions):
            raise InvalidRequest("options of the wrong type for a hyper store", field="gate")

    def with_conditions(
        self, x: np.ndarray, request: ConditionRequest | None, settings: Settings
    ) -> np.ndarray:
        """[x, I] rows from x [B, m1] and the request's conditions (422 naming the field)."""
        return self._conditions.attach(x, request, settings)

    def check_attached(self, rows: np.ndarray, settings: Settings) -> None:
        """Rows that came as [x, I] already (the v2 protocol's input): the same cap on
        distinct conditions as `with_conditions`, since each one costs a θ generation."""
        self._conditions.check_attached(rows, settings)

    @property
    def condition_ids(self) -> list[str]:
        """The names of the store's table, in table order."""
        return self._conditions.names

    def condition_of(self, name: str) -> np.ndarray:
        """A named condition's values (422 `condition_id` when the table lacks it)."""
        return self._conditions.named(name)

    def check_condition(self, values: list[float] | None) -> np.ndarray:
        """One condition's values as float32 (422 `condition`: wrong length, not finite)."""
        return self._conditions.checked(values)

    def route(self, x: torch.Tensor, options: Hashable) -> HyperRouting:
        if self.router is not None:
            return self._route_to_prototypes(x)
        conditions = x[:, self.spec.input_dim :].contiguous()
        distinct, inverse = torch.unique(conditions, dim=0, return_inverse=True)
        keys = [condition_key(self.generator.sha256, row) for row in distinct]
        ids = [self._table_keys.get(k, -1) for k in keys]
        return HyperRouting(
            tuple(keys[i] for i in inverse.tolist()),
            torch.tensor(ids, dtype=torch.int64)[inverse].reshape(-1, 1),
            conditions,
            torch.zeros((int(x.shape[0]), 1), dtype=torch.float32),
        )

    def _route_to_prototypes(self, x: torch.Tensor) -> HyperRouting:
        assert self._table is not None
        # Exact: the nearest prototype, as the build assigned training rows.
        routing = self.router.route(x, mode="exact")
        experts = routing.experts[:, :1]
        if self._prototype_keys is None:
            self._prototype_keys = [condition_key(self.generator.sha256, p) for p in self._table]
        keys = self._prototype_keys
        return HyperRouting(
            tuple(keys[k] for k in experts[:, 0].tolist()), experts, self._table[experts[:, 0]],
            routing.distances[:, :1].to(torch.float32),
        )

    def concat(self, parts: list[Any]) -> HyperRouting:
        return HyperRouting.concat(parts)

    def key_ref(self, key: str, condition: torch.Tensor, expert_id: int) -> GeneratedRef:
        """The cache key of θ for `condition`: what the pool places and the actor generates."""
        return GeneratedRef(
            sha256=key,
            path=self.generator.path,
            nbytes=self.spec.theta_nbytes,
            expert_id=expert_id,
            generator=self.generator,
            condition=condition_bytes(condition),
            spec_json=self._spec_json,
        )

    def start(self, x: torch.Tensor, routing: Any) -> _HyperRun:
        return _HyperRun(self, x, routing)

    def prefetch_keys(self, routing: Any) -> list[Any]:
        first: dict[str, int] = {}
        for row, key in enumerate(routing.keys):
            first.setdefault(key, row)
        return [
            self.key_ref(k, routing.conditions[r], int(routing.experts[r, 0]))
            for k, r in first.items()
        ]

    def generate_file(
        self, condition: np.ndarray, tmp_dir: Path | None = None
    ) -> tuple[str, bytes]:
        """θ_I as the bytes of a store expert file, generated in this process with the same
        f and the same one-condition forward the actors use; returns (key, file bytes)."""
        return self._local.generate_file(condition, tmp_dir)


class _HyperRun(OneRoundRun):
    """One batch: one round of groups (one per distinct condition), then rows in order."""

    def __init__(self, model: HyperModel, x: torch.Tensor, routing: HyperRouting) -> None:
        super().__init__()
        self._model = model
        self._x = x
        self._routing = routing

    def _groups(self) -> list[PlannedGroup]:
        by_key: dict[str, list[int]] = {}
        for row, key in enumerate(self._routing.keys):
            by_key.setdefault(key, []).append(row)
        m1 = self._model.spec.input_dim
        groups: list[PlannedGroup] = []
        # Key order, not arrival order: the same groups whatever order requests came in.
        for key in sorted(by_key):
            rows = torch.tensor(by_key[key], dtype=torch.int64)
            first = int(rows[0])
            ref = self._model.key_ref(
                key, self._routing.conditions[first], int(self._routing.experts[first, 0])
            )
            groups.append(
                PlannedGroup(
                    key=ref,
                    rows=rows,
                    weights=torch.ones(rows.shape[0], dtype=torch.float64),
                    inputs=self._x[rows, :m1].contiguous(),
                )
            )
        return groups

    def _combine(self, plan: Plan, results: Sequence[GroupResult]) -> torch.Tensor:
        good = [(g, r) for g, r in zip(plan.groups, results, strict=True) if r.error is None]
        out = torch.zeros((self._x.shape[0], self._model.spec.output_dim), dtype=torch.float32)
        for group, result in good:
            # Each row is in exactly one group and takes its output unchanged.
            out[group.rows] = result.outputs.to(torch.float32)
        return out
