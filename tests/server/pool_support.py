"""Pools addressed by one store's expert ids, as the server addresses them through that
store's `ExpertRef`s: groups go in by id, residency and resident lists come back by id."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from experts_store import Store, load_expert
from server.pool import ActorInfo, DispatchingPool, Group, GroupResult, check_budget


@dataclass(frozen=True)
class IdGroup:
    expert_id: int
    rows: torch.Tensor


def expected(store: Store, group: IdGroup) -> torch.Tensor:
    """The group's outputs computed apart from any pool: its expert's file, loaded afresh."""
    entry = store.expert_entry(group.expert_id)
    module = load_expert(store.root / entry.file, expected_sha256=entry.sha256)
    with torch.no_grad():
        result: torch.Tensor = module(group.rows)
    return result


class _IdDispatcher:
    def __init__(self, pool: IdPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool.inner.dispatcher, name)

    def home(self, expert_id: int, **kwargs: Any) -> str | None:
        home: str | None = self._pool.inner.dispatcher.home(self._pool.key(expert_id), **kwargs)
        return home


class IdPool:
    """`inner` fed one store's experts; refuses the store if an expert cannot fit (as the
    server refuses a store version whose expert exceeds the pool's budget)."""

    def __init__(self, store: Store, inner: DispatchingPool) -> None:
        self.store = store
        self.inner = inner
        self.refs = [store.expert_ref(e.id) for e in store.manifest.experts]
        self.ids = {ref.sha256: ref.expert_id for ref in self.refs}
        check_budget(self.refs, inner.budget_bytes)
        self.dispatcher = _IdDispatcher(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def key(self, expert_id: int) -> str:
        return self.refs[expert_id].sha256

    def group(self, group: IdGroup | Group) -> Group:
        if isinstance(group, Group):
            return group
        return Group(self.refs[group.expert_id], group.rows)

    async def run(
        self, groups: list[IdGroup], *, wanted: Callable[[], bool] | None = None
    ) -> list[GroupResult]:
        return await self.inner.run([self.group(g) for g in groups], wanted=wanted)

    async def prefetch(self, expert_ids: list[int]) -> None:
        await self.inner.prefetch([self.refs[e] for e in expert_ids])

    async def forget_popularity(self) -> None:
        await self.inner.forget_popularity()

    def residency(self) -> dict[int, list[str]]:
        return {self.ids[key]: actors for key, actors in self.inner.residency().items()}

    def actors(self) -> list[ActorInfo]:
        return [
            dataclasses.replace(info, resident=sorted(self.ids[k] for k in info.resident))  # type: ignore[arg-type]
            for info in self.inner.actors()
        ]
