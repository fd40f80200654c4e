"""Store kinds: format-1 stores serve as kind "momlp"; a kind the server does not know is
refused at startup and on reload, naming it (server/kinds/_registry.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from app_support import (
    app_settings,
    build_small_store,
    error_of,
    expert_outputs,
    fake_app,
    fake_pool,
    manifest,
    nearest_k,
    running,
)

from experts_store import ManifestError
from server import UnknownStoreKind, create_app
from server.kinds import KINDS

pytestmark = pytest.mark.unit


def as_format_1(store: Path) -> None:
    """Rewrite manifest.json exactly as the format-1 writer wrote it: no kind, no gate."""
    data = manifest(store)
    data.pop("kind")
    data.pop("gate")
    data["format_version"] = 1
    (store / "manifest.json").write_text(json.dumps(data, indent=2) + "\n")


def rewrite(store: Path, **fields: object) -> None:
    data = manifest(store)
    data.update(fields)
    (store / "manifest.json").write_text(json.dumps(data, indent=2) + "\n")


def test_the_writer_publishes_format_2_with_kind_and_gate(tmp_path: Path) -> None:
    data = manifest(build_small_store(tmp_path / "s"))
    assert data["format_version"] == 2 and data["kind"] == "momlp"
    assert data["gate"]["temperature"] == data["temperature"] == 1.0
    assert data["gate"]["score"] == "sqdist"


async def test_a_format_1_store_loads_and_serves_unchanged(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "s", K=8, n=4)
    x = np.random.default_rng(3).standard_normal((40, 4)).astype(np.float32)
    async with running(fake_app(store)) as client:
        v2 = (await client.post("/v1/predict", json={"inputs": x.tolist(), "top_k": 2})).json()
        v2_top1 = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
    as_format_1(store)
    async with running(fake_app(store)) as client:
        model = (await client.get("/v1/model")).json()
        top1 = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
        top2 = (await client.post("/v1/predict", json={"inputs": x.tolist(), "top_k": 2})).json()
    assert (model["format_version"], model["kind"], model["temperature"]) == (1, "momlp", 1.0)
    assert model["gate"]["temperature"] == 1.0
    # Top-1: each row is its expert's own output, bit for bit the format-2 store's answer.
    assert top1 == {**v2_top1, "store_version": top1["store_version"]}
    for i, (e,) in enumerate(top1["experts"]):
        want = expert_outputs(store, e, x[i : i + 1])[0]
        np.testing.assert_allclose(top1["outputs"][i], want, rtol=1e-6, atol=1e-6)
    # Top-2: the k nearest prototypes with softmax(-d²/1.0) weights, as format 1 served them.
    idx, d2 = nearest_k(store, x, 2)
    assert top2["experts"] == idx.tolist()
    gate = np.exp(-d2) / np.exp(-d2).sum(1, keepdims=True)
    np.testing.assert_allclose(top2["weights"], gate, rtol=1e-6)
    np.testing.assert_allclose(top2["outputs"], v2["outputs"], rtol=0, atol=0)


async def test_an_unknown_kind_is_refused_at_startup_naming_it(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "s")
    rewrite(store, kind="warpdrive")
    app = create_app(app_settings(store), pool_factory=fake_pool)
    with pytest.raises(UnknownStoreKind) as info:
        async with running(app):
            pass
    assert info.value.kind == "warpdrive"
    assert "warpdrive" in str(info.value) and "momlp" in str(info.value)
    assert "warpdrive" not in KINDS


async def test_an_unknown_kind_is_refused_on_reload_and_the_old_version_serves(
    tmp_path: Path,
) -> None:
    store = build_small_store(tmp_path / "s")
    served = manifest(store)["store_version"]
    x = np.zeros((1, 4), dtype=np.float32).tolist()
    async with running(fake_app(store)) as client:
        rewrite(store, kind="graph", store_version="next-version")
        response = await client.post("/v1/admin/reload")
        assert response.status_code == 503
        error = error_of(response)
        assert error["code"] == "reload_failed" and "'graph'" in error["detail"]["reason"]
        answer = await client.post("/v1/predict", json={"inputs": x})
        assert answer.status_code == 200 and answer.json()["store_version"] == served


def _store_with_a_router_of_another_dimension(root: Path) -> Path:
    """Experts and manifest for 2-D inputs, a router (valid, hash-named) of 5-D prototypes."""
    import torch

    from experts_store import ExpertArch, ExpertMLP, StoreWriter
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(0)
    with StoreWriter(root) as writer:
        for expert_id in range(4):
            expert = ExpertMLP(ExpertArch(widths=(2, 8, 1)), generator=generator)
            writer.add_expert(expert_id, expert)
        PrototypeTree.build(torch.randn(4, 5, generator=generator), branching=2, seed=0).save(
            writer.router_path
        )
        writer.publish(task="regression", input_dim=2, output_dim=1, routing="tree", branching=2)
    return root


async def test_a_router_of_another_dimension_than_the_manifest_never_goes_live(
    tmp_path: Path,
) -> None:
    # Every request would be refused by one check or the other (2 columns: the router's;
    # 5: the manifest's), so such a store must fail to start, and fail a reload.
    bad = _store_with_a_router_of_another_dimension(tmp_path / "bad")
    with pytest.raises(ManifestError, match="dimension 5, the manifest.s input_dim is 2"):
        async with running(create_app(app_settings(bad), pool_factory=fake_pool)):
            pass
    store = build_small_store(tmp_path / "s", n=2)
    served = manifest(store)["store_version"]
    async with running(fake_app(store)) as client:
        shutil.copytree(bad, store, dirs_exist_ok=True)  # its manifest replaces the served one
        response = await client.post("/v1/admin/reload")
        assert response.status_code == 503, response.text
        assert "input_dim is 2" in error_of(response)["detail"]["reason"]
        answer = await client.post("/v1/predict", json={"inputs": [[0.0, 0.0]]})
        assert answer.status_code == 200 and answer.json()["store_version"] == served


def test_the_kinds_store_verify_knows_are_the_kinds_the_server_serves() -> None:
    from experts_store import STORE_KINDS

    assert set(STORE_KINDS) == set(KINDS)


async def test_a_kind_tells_get_v1_model_its_experts_and_its_own_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new kind adds a model, not a branch in the HTTP floor (STYLE.md rule 17): what rows
    # can be routed to, and the kind's own block of /v1/model, are the model's to say.
    from experts_store import Pace, Store
    from server.kinds import HyperSection, ModelSection, MomlpModel

    class Generated(MomlpModel):
        """momlp underneath; says rows reach 3 generated experts, and shows its generator."""

        @property
        def routable_experts(self) -> int:
            return 3

        def model_section(self) -> ModelSection:
            return ModelSection(hyper=HyperSection(
                condition_dim=2, theta_bytes=40, generator_bytes=400, primary_widths=[4, 2],
                condition_source="prototype", condition_ids=["a", "b", "c"],
            ))

    def open_generated(store: Store, pace: Pace) -> Generated:
        plain = MomlpModel.open(store, pace)
        return Generated(plain.router, plain.experts, store.manifest)

    monkeypatch.setitem(KINDS, "momlp", open_generated)
    store = build_small_store(tmp_path / "s", K=8)
    async with running(fake_app(store)) as client:
        model = (await client.get("/v1/model")).json()
    assert model["num_experts"] == 3 and model["kind"] == "momlp" and model["pmoe"] is None
    assert model["hyper"] == {
        "condition_dim": 2, "theta_bytes": 40, "generator_bytes": 400, "primary_widths": [4, 2],
        "condition_source": "prototype", "condition_ids": ["a", "b", "c"],
    }


async def test_the_kind_endpoints_answer_404_naming_the_served_kind(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "s")
    async with running(fake_app(store)) as client:
        graph = await client.get("/v1/graph")
        generate = await client.post("/v1/generate", json={"condition": [1.0]})
        model = (await client.get("/v1/model")).json()
    assert graph.status_code == 404
    assert error_of(graph)["message"] == "the served store is of kind 'momlp', not graph"
    assert generate.status_code == 404
    assert error_of(generate)["detail"] == {"kind": "momlp"}
    assert (model["num_experts"], model["pmoe"], model["hyper"]) == (8, None, None)
