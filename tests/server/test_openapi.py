"""/openapi.json states what the served kind enforces, as the kind itself tells it (STYLE.md
rule 17): how many beam widths a gate may give, and whether rows take conditions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from app_support import build_small_store, error_of, fake_app, running

from experts_store import Pace, Store
from server.kinds import KINDS, MomlpModel
from trainer.hyper import HyperNetwork, PrimarySpec, publish_hypernetwork

pytestmark = pytest.mark.unit

CONDITION_FIELDS = {"conditions", "condition", "condition_ids"}


def predict_body(spec: dict[str, Any]) -> dict[str, Any]:
    content = spec["paths"]["/v1/predict"]["post"]["requestBody"]["content"]
    body: dict[str, Any] = content["application/json"]["schema"]
    return body


def beam_max_items(spec: dict[str, Any]) -> int:
    gate = next(o for o in predict_body(spec)["properties"]["gate"]["anyOf"]
                if o.get("type") == "object")
    beam = next(o for o in gate["properties"]["beam"]["anyOf"] if o.get("type") == "array")
    return int(beam["maxItems"])


async def test_the_schema_states_the_beam_levels_the_kind_enforces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kind says how many widths a beam may give; the schema and the gate both ask it, not
    # an attribute of the kind's that happens to be called `router`.
    class OneLevel(MomlpModel):
        @property
        def beam_levels(self) -> int:
            return 1

    def open_one_level(store: Store, pace: Pace) -> OneLevel:
        plain = MomlpModel.open(store, pace)
        return OneLevel(plain.router, plain.experts, store.manifest)

    store = build_small_store(tmp_path / "s", K=8)  # a tree of 2 levels
    x = [[0.5, -0.5, 0.25, 1.0]]
    async with running(fake_app(store)) as client:
        plain = (await client.get("/openapi.json")).json()
    monkeypatch.setitem(KINDS, "momlp", open_one_level)
    async with running(fake_app(store)) as client:
        spec = (await client.get("/openapi.json")).json()
        one = await client.post("/v1/route", json={"inputs": x, "gate": {"beam": [2]}})
        two = await client.post("/v1/route", json={"inputs": x, "gate": {"beam": [2, 2]}})
    assert beam_max_items(plain) == 2
    assert beam_max_items(spec) == 1
    assert one.status_code == 200, one.text
    assert two.status_code == 422
    assert error_of(two)["detail"]["field"] == "beam"


async def test_only_a_kind_that_takes_conditions_documents_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    f = HyperNetwork(3, PrimarySpec(2, (4,), 1), depth=1, width=8)
    publish_hypernetwork(tmp_path / "hyper", f, conditions=torch.randn(2, 3),
                         condition_ids=["a", "b"])
    momlp = build_small_store(tmp_path / "momlp", K=8, n=2)
    x = np.zeros((1, 2), dtype=np.float32).tolist()
    async with running(fake_app(tmp_path / "hyper")) as client:
        hyper_spec = (await client.get("/openapi.json")).json()
        named = await client.post("/v1/predict", json={"inputs": x, "condition_ids": ["a"]})
    async with running(fake_app(momlp)) as client:
        momlp_spec = (await client.get("/openapi.json")).json()
        refused = await client.post("/v1/predict", json={"inputs": x, "condition_ids": ["a"]})
    assert CONDITION_FIELDS <= set(predict_body(hyper_spec)["properties"])
    assert named.status_code == 200, named.text
    assert not CONDITION_FIELDS & set(predict_body(momlp_spec)["properties"])
    assert refused.status_code == 422
    assert error_of(refused)["message"] == "a store of kind 'momlp' takes no conditions"
    assert error_of(refused)["detail"]["field"] == "condition_ids"
