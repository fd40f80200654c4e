from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

from server.http._construct import trusted
from server.http._models import (
    ExpertStatModel,
    GraphStatsModel,
    PredictResponse,
    PredictStats,
)

pytestmark = pytest.mark.unit

STAT: dict[str, Any] = dict(
    expert_id=3, rows=2, cache="miss", load_ms=0.4, compute_ms=0.03, actor="actor-1",
    expert_bytes=563232, activation_bytes=1234, vram_bytes=600000, key=None,
    generator_bytes=0, node="n0", wave=1,
)
STATS: dict[str, Any] = dict(
    vram_bytes=600000, device_bytes={"actor-1": 9}, distance_evals=[8, 8],
    route_ms=0.1, queue_ms=0.2, total_ms=0.3,
)


def _same(cls: type[BaseModel], **values: Any) -> BaseModel:
    fast, slow = trusted(cls, **values), cls.model_construct(**values)
    assert type(fast) is cls
    assert fast == slow
    assert fast.model_dump_json() == slow.model_dump_json()
    assert fast.model_fields_set == slow.model_fields_set
    return fast


def test_trusted_builds_the_model_model_construct_builds() -> None:
    stat = _same(ExpertStatModel, **STAT)
    # Fields in another order, optional ones left out: laid out and defaulted the same.
    _same(ExpertStatModel, **dict(reversed(list(STAT.items()))))
    _same(ExpertStatModel, **{k: v for k, v in STAT.items() if k not in ("node", "wave")})
    graph = _same(GraphStatsModel, waves=1, wave_vram_bytes=[5], peak_wave_vram_bytes=5,
                  node_distance_evals={"n0": [1]})
    stats = _same(PredictStats, experts=[stat], graph=graph, **STATS)
    _same(PredictStats, experts=[], **STATS)
    _same(PredictResponse, outputs=[[1.5]], experts=[[3]], weights=[[1.0]],
          store_version="v1", stats=stats, patches=None, nodes=None)


def test_a_set_after_trusted_counts_as_set_and_instances_share_nothing() -> None:
    first = trusted(PredictStats, experts=[], **STATS)
    second = trusted(PredictStats, experts=[], **STATS)
    first.patches_computed = 4
    assert "patches_computed" in first.model_fields_set
    assert "patches_computed" not in second.model_fields_set
    assert second.patches_computed is None


class _Factory(BaseModel):
    items: list[int] = Field(default_factory=list)


class _Aliased(BaseModel):
    value: int = Field(alias="v")


def test_models_it_cannot_lay_out_go_to_model_construct() -> None:
    made = trusted(_Factory)
    assert made.items == [] and made.items is not trusted(_Factory).items
    assert trusted(_Aliased, v=3).value == 3
    # An unknown field is ignored and a missing required one stays missing, as there.
    assert trusted(_Factory, nope=1) == _Factory.model_construct(nope=1)
    assert trusted(ExpertStatModel, rows=1).model_fields_set == {"rows"}
