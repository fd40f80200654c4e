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


def _graph(root: Path) -> Path:
    from graph_support import tiny_graph_store

    tiny_graph_store(root)
    return root


def _hyper_prototype(root: Path) -> Path:
    from router import PrototypeTree

    torch.manual_seed(8)
    f = HyperNetwork(4, PrimarySpec(4, (8,), 2), depth=1, width=32)
    protos = torch.randn(12, 4, generator=torch.Generator().manual_seed(9))
    publish_hypernetwork(root, f, conditions=protos, condition_ids=[str(k) for k in range(12)],
                         router=PrototypeTree.build(protos, branching=4, seed=0))
    return root


def _pmoe_expert_choice(root: Path) -> Path:
    from experts_store import ImageLayout
    from trainer.pmoe import PatchMoE, publish_pmoe

    image = ImageLayout(height=6, width=4, channels=2, patch_height=3, patch_width=2)
    model = PatchMoE(num_patches=image.num_patches, patch_dim=image.patch_dim, num_experts=3,
                     patches_per_expert=2, hidden=5, num_classes=3, gating="softmax",
                     router_init_std=1.0, expert_init_std=0.5, seed=0)
    publish_pmoe(model, root, train="joint", image=image)
    return root


# Per kind: the gate options a request may set, as the kind's `resolve` takes them.
_REFUSED = {"top_k": 2, "mode": "exact", "temperature": 1.0, "min_weight": 0.1, "top_p": 0.5,
            "beam": [2], "score": "softmax"}


@pytest.mark.parametrize(
    ("build", "taken"),
    [(_graph, {"mode"}), (_hyper_prototype, set()), (_pmoe_expert_choice, set())],
    ids=["graph", "hyper-prototype", "pmoe-expert-choice"],
)
async def test_the_schema_leaves_out_what_the_kind_refuses(
    tmp_path: Path, build: Any, taken: set[str]
) -> None:
    # It listed every gate option for every kind (and top_k up to K, or 0 for a hyper
    # store): schema-valid requests the server then refused with 422.
    root = build(tmp_path / "store")
    async with running(fake_app(root)) as client:
        spec = (await client.get("/openapi.json")).json()
        dim = (await client.get("/v1/model")).json()["input_dim"]
        x = [[0.0] * dim]
        answers = {}
        for name, value in _REFUSED.items():
            gated = name not in ("top_k", "mode")
            body = {"inputs": x, **({"gate": {name: value}} if gated else {name: value})}
            answers[name] = await client.post("/v1/predict", json=body)
        plain = await client.post("/v1/predict", json={"inputs": x, "top_k": 1, "gate": {}})
    body = predict_body(spec)
    gate = next(o for o in body["properties"]["gate"]["anyOf"] if o.get("type") == "object")
    listed = set(gate.get("properties", {})) | ({"mode"} & set(body["properties"]))
    assert listed == taken - {"top_k"}
    top_k = next(o for o in body["properties"]["top_k"]["anyOf"] if o.get("type") == "integer")
    assert top_k["maximum"] == 1
    params = {p["name"] for p in spec["paths"]["/v1/predict"]["post"]["parameters"]}
    assert params & set(_REFUSED) == {"top_k"} | taken
    assert plain.status_code == 200, plain.text
    for name, answer in answers.items():
        if name not in taken:
            assert answer.status_code == 422, (name, answer.text)


async def test_a_binary_bodys_query_gate_is_bounded_as_the_json_gate_is(tmp_path: Path) -> None:
    # The query's beam and temperature were bounded by type only: ?beam=2,2,2 on a 2-level
    # tree, ?beam=999999 and ?temperature=0.0001 were schema-valid and refused with 422.
    import re

    store = build_small_store(tmp_path / "s", K=8)  # a tree of 2 levels, max_beam 8
    raw = np.zeros((1, 4), dtype="<f4").tobytes()
    headers = {"Content-Type": "application/octet-stream", "X-Momlp-Rows": "1"}
    async with running(fake_app(store)) as client:
        spec = (await client.get("/openapi.json")).json()
        answers = {
            query: await client.post(f"/v1/predict?{query}", content=raw, headers=headers)
            for query in ("beam=2,2", "beam=8", "beam=2,2,2", "beam=9", "temperature=0.0001")
        }
    operation = spec["paths"]["/v1/predict"]["post"]
    parameters = {p["name"]: p["schema"] for p in operation["parameters"]}
    beam = next(o for o in parameters["beam"]["anyOf"] if o.get("type") == "string")
    temperature = next(o for o in parameters["temperature"]["anyOf"] if o.get("type") == "number")
    gate = next(o for o in predict_body(spec)["properties"]["gate"]["anyOf"]
                if o.get("type") == "object")
    json_temperature = next(o for o in gate["properties"]["temperature"]["anyOf"]
                            if o.get("type") == "number")
    assert (temperature["minimum"], temperature["maximum"]) == (
        json_temperature["minimum"], json_temperature["maximum"]
    )
    for query, answer in answers.items():
        name, value = query.split("=")
        if name == "beam":
            allowed = re.search(beam["pattern"], value) is not None
        else:
            allowed = temperature["minimum"] <= float(value) <= temperature["maximum"]
        assert answer.status_code == (200 if allowed else 422), (query, answer.text)
    assert [q for q, a in answers.items() if a.status_code == 200] == ["beam=2,2", "beam=8"]


async def test_a_kind_that_needs_conditions_documents_only_requests_that_bring_them(
    tmp_path: Path,
) -> None:
    # The schema let a request give no condition, or ones of any width, or unknown names, or
    # a binary body (which cannot carry them): each refused with 422.
    torch.manual_seed(0)
    f = HyperNetwork(3, PrimarySpec(2, (4,), 1), depth=1, width=8)
    publish_hypernetwork(tmp_path / "named", f, conditions=torch.randn(2, 3),
                         condition_ids=["a", "b"])
    publish_hypernetwork(tmp_path / "unnamed", f)
    x = [[0.0, 0.0]]
    bodies = {
        "none": {"inputs": x},
        "narrow": {"inputs": x, "condition": [0.5]},
        "unknown": {"inputs": x, "condition_ids": ["z"]},
        "named": {"inputs": x, "condition_ids": ["a"]},
        "given": {"inputs": x, "condition": [0.5, 0.5, 0.5]},
    }
    async with running(fake_app(tmp_path / "named")) as client:
        spec = (await client.get("/openapi.json")).json()
        answers = {k: await client.post("/v1/predict", json=b) for k, b in bodies.items()}
    async with running(fake_app(tmp_path / "unnamed")) as client:
        unnamed = (await client.get("/openapi.json")).json()
        by_name = await client.post("/v1/predict", json=bodies["named"])
    operation = spec["paths"]["/v1/predict"]["post"]
    assert list(operation["requestBody"]["content"]) == ["application/json"]
    body = predict_body(spec)
    assert [o["required"] for o in body["anyOf"]] == [
        ["conditions"], ["condition"], ["condition_ids"]
    ]
    condition = next(o for o in body["properties"]["condition"]["anyOf"]
                     if o.get("type") == "array")
    assert condition["minItems"] == condition["maxItems"] == 3
    names = next(o for o in body["properties"]["condition_ids"]["anyOf"]
                 if o.get("type") == "array")
    assert names["items"]["enum"] == ["a", "b"]
    assert {k: a.status_code for k, a in answers.items()} == {
        "none": 422, "narrow": 422, "unknown": 422, "named": 200, "given": 200
    }
    assert "condition_ids" not in predict_body(unnamed)["properties"]
    assert by_name.status_code == 422, by_name.text
