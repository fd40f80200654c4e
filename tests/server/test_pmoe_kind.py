"""Kind "pmoe" in process (the fake pool runs the real ActorCore): routing, combine, bodies.

Stores here are untrained `PatchMoE`s published by `trainer.pmoe.publish_pmoe`, on an odd
layout (6x4x2 images of 3x2 patches: n = 4, d = 12; 5 neurons per expert) so that padding to
aligned widths is exercised. The trained models through a real `momlp serve` are in
tests/integration/test_pmoe_live.py.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from app_support import build_small_store, fake_app, running

from experts_store import ImageLayout, ManifestError, Store, StoreWriter
from router import PrototypeTree
from server.kinds import PatchModel, PatchOptions, PatchRouting
from trainer.pmoe import (
    PatchMoE,
    image_to_patches,
    predict_logits,
    publish_pmoe,
    token_choice_logits,
)

pytestmark = pytest.mark.unit

IMAGE = ImageLayout(height=6, width=4, channels=2, patch_height=3, patch_width=2)
N, D = IMAGE.num_patches, IMAGE.patch_dim


def patch_model(*, gating: str = "softmax", num_classes: int = 3, seed: int = 0) -> PatchMoE:
    return PatchMoE(
        num_patches=N, patch_dim=D, num_experts=3, patches_per_expert=2, hidden=5,
        num_classes=num_classes, gating=gating, router_init_std=1.0,  # type: ignore[arg-type]
        expert_init_std=0.5, seed=seed,
    )


def images(count: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((count, *IMAGE.shape), dtype=np.float32)


def rows_of(batch: np.ndarray) -> np.ndarray:
    return image_to_patches(batch, (3, 2)).reshape(len(batch), N * D)


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


async def predict_npy(client: Any, array: np.ndarray, **params: Any) -> Any:
    return await client.post(
        "/v1/predict", content=npy(array), params=params,
        headers={"content-type": "application/x-npy"},
    )


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, PatchMoE]:
    model = patch_model()
    publish_pmoe(model, tmp_path / "store", train="joint", image=IMAGE)
    return tmp_path / "store", model


async def test_outputs_routing_and_images_agree_with_the_offline_model(
    store: tuple[Path, PatchMoE],
) -> None:
    root, model = store
    batch = images(64)
    x = rows_of(batch)
    offline = predict_logits(model, torch.from_numpy(x)).numpy()
    with torch.no_grad():
        expected = model.route(torch.from_numpy(x))
    async with running(fake_app(root)) as client:
        answer = await client.post(
            "/v1/predict", json={"inputs": x.tolist(), "return_routing": True,
                                 "return_stats": True},
        )
        by_image = await predict_npy(client, batch, return_routing="true")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert np.abs(np.asarray(body["outputs"]) - offline).max() <= 1e-5
    assert by_image.json()["outputs"] == body["outputs"]
    patches = [[e["patches"] for e in row] for row in body["patches"]]
    gates = [[e["gates"] for e in row] for row in body["patches"]]
    assert patches == expected.indices.tolist()
    np.testing.assert_array_equal(np.asarray(gates), expected.gates.double().numpy())
    assert body["stats"]["patches_computed"] * N == body["stats"]["patches_dense"] * 2
    assert body["experts"][0] == [0, 1, 2] and body["weights"][0] == pytest.approx([1 / 3] * 3)


async def test_each_samples_output_is_bitwise_the_same_in_any_batch(
    store: tuple[Path, PatchMoE],
) -> None:
    root, _ = store
    x = rows_of(images(120, seed=2))
    rng = np.random.default_rng(3)
    async with running(fake_app(root)) as client:
        whole = (await predict_npy(client, x)).json()["outputs"]
        for sample in range(0, 120, 9):
            alone = (await predict_npy(client, x[sample : sample + 1])).json()["outputs"][0]
            order = rng.permutation(120)[: int(rng.integers(2, 120))]
            order = np.append(order[order != sample], sample)
            rng.shuffle(order)
            mixed = (await predict_npy(client, x[order])).json()["outputs"]
            assert alone == whole[sample] == mixed[int(np.flatnonzero(order == sample)[0])]


async def test_bad_shapes_and_knobs_are_422_naming_what_is_expected(
    store: tuple[Path, PatchMoE], tmp_path: Path
) -> None:
    root, _ = store
    async with running(fake_app(root)) as client:
        for shape in [(2, 6, 4, 1), (2, 4, 6, 2), (2, 6, 4), (2, 6, 4, 2, 1)]:
            wrong = await predict_npy(client, np.zeros(shape, dtype=np.float32))
            assert wrong.status_code == 422
            assert "[B, 6, 4, 2]" in wrong.json()["error"]["message"]
        flat = await client.post("/v1/predict", json={"inputs": [[0.0] * (N * D - 1)]})
        assert flat.status_code == 422 and str(N * D) in flat.json()["error"]["message"]
        for body, field in [
            ({"top_k": 2}, "top_k"),
            ({"gate": {"temperature": 2.0}}, "temperature"),
            ({"mode": "exact"}, "mode"),
        ]:
            refused = await client.post("/v1/predict", json={"inputs": [[0.0] * N * D], **body})
            assert refused.status_code == 422
            assert refused.json()["error"]["detail"]["field"] == field
    momlp = build_small_store(tmp_path / "momlp")
    async with running(fake_app(momlp)) as client:
        routing = await client.post(
            "/v1/predict", json={"inputs": [[0.0] * 4], "return_routing": True}
        )
        assert routing.status_code == 200 and routing.json()["patches"] is None
        image = await predict_npy(client, np.zeros((1, 2, 2, 1), dtype=np.float32))
        assert image.status_code == 422 and "2-D" in image.json()["error"]["message"]


async def test_token_choice_computes_only_the_experts_its_patches_picked(tmp_path: Path) -> None:
    model = patch_model(gating="ones", seed=4)
    protos = torch.randn(3, D, generator=torch.Generator().manual_seed(5))
    tree = PrototypeTree.build(protos, branching=2)
    root = tmp_path / "token"
    publish_pmoe(model, root, image=IMAGE, routing="token_choice", tree=tree)
    x = rows_of(images(50, seed=6))
    async with running(fake_app(root)) as client:
        for mode in ("tree", "exact"):
            offline = token_choice_logits(model, tree, torch.from_numpy(x), mode=mode).numpy()
            routed = (
                await client.post("/v1/route", json={"inputs": x.tolist(), "mode": mode})
            ).json()
            answer = (
                await client.post(
                    "/v1/predict", json={"inputs": x.tolist(), "mode": mode, "return_stats": True}
                )
            ).json()
            assert np.abs(np.asarray(answer["outputs"]) - offline).max() <= 1e-5
            picked = {e["expert_id"] for row in routed["patches"] for e in row}
            assert {s["expert_id"] for s in answer["stats"]["experts"]} == picked
            assert answer["stats"]["patches_computed"] == 50 * N
            assert all(sum(len(e["patches"]) for e in row) == N for row in routed["patches"])


def test_routing_slices_and_concatenations_are_row_by_row(store: tuple[Path, PatchMoE]) -> None:
    root, _ = store
    model = PatchModel.open(Store.open(root))
    x = torch.from_numpy(rows_of(images(30, seed=7)))
    whole = model.route(x, PatchOptions())
    parts = [model.route(x[a:b], PatchOptions()) for a, b in [(0, 7), (7, 8), (8, 30)]]
    joined = PatchRouting.concat(parts)
    for name in ("slot_expert", "slot_patch", "slot_gate", "experts", "weights"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
        assert torch.equal(getattr(whole.slice(7, 8), name), getattr(parts[1], name)), name
    assert whole.dense_patches == 30 * N * 3


def test_the_manifest_refuses_a_pmoe_block_that_does_not_fit(
    store: tuple[Path, PatchMoE], tmp_path: Path
) -> None:
    root, _ = store
    manifest = Store.open(root).manifest
    assert manifest.pmoe is not None and manifest.pmoe.layout.expert_input_dim == 16
    assert manifest.experts[0].arch["widths"] == [16, 8, 3]
    data = manifest.model_dump()
    for change, message in [
        ({"pmoe": None}, "go together"),
        ({"kind": "momlp"}, "go together"),
        ({"input_dim": N * D + 1}, "n·d"),
        ({"output_dim": 2}, "num_classes"),
    ]:
        with pytest.raises(ValueError, match=message):
            type(manifest).model_validate({**data, **change})
    bad_layout = {**data["pmoe"], "layout": {"num_patches": N, "patch_dim": 8, "image": None}}
    with pytest.raises(ValueError, match="a patch expert maps"):
        type(manifest).model_validate({**data, "pmoe": bad_layout, "input_dim": N * 8})
    with StoreWriter(tmp_path / "bad") as writer, pytest.raises(ManifestError):
        writer.router_path.write_bytes(b"x")
        writer.publish(task="classification", input_dim=3, output_dim=2, routing="exact",
                       branching=2, kind="pmoe")


def test_a_pmoe_stores_files_are_all_as_readable_as_its_experts(
    store: tuple[Path, PatchMoE],
) -> None:
    # safetensors' save_file creates 0600 files: a server or Ray worker running as another
    # user on shared storage could read the experts but not a linear router written so.
    from experts_store import Store

    root, _ = store
    opened = Store.open(root)
    modes = {
        path.name: path.stat().st_mode & 0o777
        for path in (opened.router_path, root / opened.manifest.experts[0].file)
    }
    assert len(set(modes.values())) == 1, modes
    assert Store.open(root).verify() == []  # a linear router is no prototype tree: no problem


async def test_get_v1_model_shows_the_stores_patch_layout(store: tuple[Path, PatchMoE]) -> None:
    root, _ = store
    async with running(fake_app(root)) as client:
        model = (await client.get("/v1/model")).json()
    manifest = Store.open(root).manifest
    assert model["kind"] == "pmoe" and model["num_experts"] == 3 and model["hyper"] is None
    assert manifest.pmoe is not None
    assert model["pmoe"] == manifest.pmoe.model_dump(mode="json")
