"""Patch-level routing (kind pmoe) through a real `momlp serve`: a child process, embedded
Ray, two actors, stores trained by `trainer.pmoe` and compared with the trained models.

One server for the module: each test republishes the store it needs into the served root
and reloads (`/v1/admin/reload`), so Ray starts once.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from live_support import serve_process

import client
from trainer.pmoe import (
    PMoEBuild,
    PMoEBuildConfig,
    build_pmoe,
    patches_to_image,
    predict_logits,
    publish_pmoe,
    token_choice_logits,
)

pytestmark = [pytest.mark.integration, pytest.mark.ray]

TINY = {"num_train": 200, "epochs": 4, "router_epochs": 4}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PMoEBuild]:
    root = tmp_path_factory.mktemp("pmoe-builds")

    def build(name: str, **options: Any) -> PMoEBuild:
        return build_pmoe(PMoEBuildConfig(out=root / name, **{**TINY, **options}), progress=False)

    return {
        "separate": build("separate", num_test=1000),
        "joint": build("joint", train="joint", num_experts=4, patches_per_expert=3, num_test=1000),
        "token": build(
            "token", train="joint", num_experts=8, patches_per_expert=4,
            routing="token_choice", num_test=200,
        ),
        "four": build("four", dataset="digits-patches-4class", num_test=300),
    }


@dataclass
class Served:
    url: str
    root: Path
    builds: dict[str, PMoEBuild]

    def use(self, name: str) -> PMoEBuild:
        """Publish build `name` into the served store and make it the served version."""
        build = self.builds[name]
        spec = build.manifest.pmoe
        assert spec is not None
        publish_pmoe(
            build.model, self.root, train=spec.train, image=spec.layout.image,
            routing=spec.routing, tree=build.tree,
        )
        answer = httpx.post(f"{self.url}/v1/admin/reload", timeout=60)
        assert answer.status_code == 200 and answer.json()["reloaded"], answer.text
        return build


@pytest.fixture(scope="module")
def served(
    builds: dict[str, PMoEBuild], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("pmoe-served") / "store"
    first = builds["separate"]
    spec = first.manifest.pmoe
    assert spec is not None
    publish_pmoe(first.model, root, train=spec.train, image=spec.layout.image)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    args = [
        "--store", str(root), "--port", "0", "--actors", "2", "--ray-num-cpus", "2",
        "--no-watch-store",
    ]
    with serve_process(args, env=env, cwd=root.parent) as process:
        yield Served(process.url, root, builds)
    assert "Traceback" not in "".join(process.log)


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, dtype=np.float32))
    return buf.getvalue()


def post_npy(url: str, path: str, array: np.ndarray, **params: Any) -> httpx.Response:
    return httpx.post(
        f"{url}{path}", content=npy(array), params=params,
        headers={"content-type": "application/x-npy"}, timeout=120,
    )


def flat(build: PMoEBuild) -> np.ndarray:
    return build.x_test.reshape(len(build.x_test), -1).numpy()


@pytest.mark.parametrize("name", ["separate", "joint"])
def test_served_outputs_equal_the_offline_model_and_route_its_top_l(
    served: Served, name: str
) -> None:
    build = served.use(name)
    x = flat(build)
    assert len(x) == 1000
    offline = predict_logits(build.model, build.x_test).numpy()
    answer = post_npy(served.url, "/v1/predict", x, return_stats="true")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    outputs = np.asarray(body["outputs"])
    assert np.abs(outputs - offline).max() <= 1e-5
    assert (outputs.argmax(1) == offline.argmax(1)).all()

    # Patches computed against n·k: exactly l/n of a dense mixture's.
    stats = body["stats"]
    model = build.model
    assert stats["patches_dense"] == 1000 * model.num_patches * model.num_experts
    assert stats["patches_computed"] == sum(s["rows"] for s in stats["experts"])
    ratio = Fraction(stats["patches_computed"], stats["patches_dense"])
    assert ratio == Fraction(model.patches_per_expert, model.num_patches)

    routed = post_npy(served.url, "/v1/route", x)
    assert routed.status_code == 200, routed.text
    with torch.no_grad():
        expected = model.route(build.x_test)
    indices = np.array([[e["patches"] for e in row] for row in routed.json()["patches"]])
    gates = np.array([[e["gates"] for e in row] for row in routed.json()["patches"]])
    assert np.array_equal(indices, expected.indices.numpy())
    np.testing.assert_array_equal(gates, expected.gates.double().numpy())


def test_image_bodies_are_cut_like_the_trainer_and_a_wrong_shape_is_422(served: Served) -> None:
    build = served.use("separate")
    images = patches_to_image(build.x_test[:40].numpy(), (4, 4), (8, 8))
    assert images.shape == (40, 32, 32, 1)
    by_image = post_npy(served.url, "/v1/predict", images, return_routing="true")
    by_rows = post_npy(served.url, "/v1/predict", flat(build)[:40], return_routing="true")
    assert by_image.status_code == by_rows.status_code == 200, by_image.text
    assert by_image.json()["outputs"] == by_rows.json()["outputs"]
    with torch.no_grad():
        expected = build.model.route(build.x_test[:40]).indices.tolist()
    assert [[e["patches"] for e in row] for row in by_image.json()["patches"]] == expected

    for shape in [(2, 32, 31, 1), (2, 32, 32, 3), (2, 32, 32)]:
        wrong = post_npy(served.url, "/v1/predict", np.zeros(shape))
        assert wrong.status_code == 422, wrong.text
        assert "[B, 32, 32, 1]" in wrong.json()["error"]["message"]
    two_d = post_npy(served.url, "/v1/predict", np.zeros((2, 1000)))
    assert two_d.status_code == 422 and "1024" in two_d.json()["error"]["message"]


def test_a_samples_output_is_bitwise_the_same_alone_and_inside_a_batch(served: Served) -> None:
    build = served.use("joint")
    x = flat(build)
    rng = np.random.default_rng(0)
    for sample in rng.choice(len(x), size=12, replace=False):
        alone = post_npy(served.url, "/v1/predict", x[sample : sample + 1]).json()["outputs"][0]
        others = rng.choice(len(x), size=int(rng.integers(5, 200)), replace=False)
        at = int(rng.integers(0, len(others)))
        batch = np.concatenate([x[others[:at]], x[sample : sample + 1], x[others[at:]]])
        inside = post_npy(served.url, "/v1/predict", batch).json()["outputs"][at]
        assert inside == alone, sample


def test_token_choice_loads_only_the_experts_some_patch_picked(served: Served) -> None:
    build = served.use("token")
    assert build.tree is not None
    x = flat(build)
    offline = token_choice_logits(build.model, build.tree, build.x_test).numpy()
    answer = post_npy(served.url, "/v1/route", x).json()
    picked = [{e["expert_id"] for e in row} for row in answer["patches"]]
    sample = min(range(len(x)), key=lambda r: len(picked[r]))
    assert len(picked[sample]) < build.model.num_experts

    one = post_npy(served.url, "/v1/predict", x[sample : sample + 1], return_stats="true").json()
    assert {s["expert_id"] for s in one["stats"]["experts"]} == picked[sample]
    assert all(s["cache"] == "miss" for s in one["stats"]["experts"])
    assert one["stats"]["patches_computed"] == build.model.num_patches
    experts = httpx.get(f"{served.url}/v1/experts", timeout=30).json()["experts"]
    assert {e["id"] for e in experts if e["actors"]} == picked[sample]
    np.testing.assert_allclose(one["outputs"][0], offline[sample], rtol=0, atol=1e-5)

    everything = post_npy(served.url, "/v1/predict", x).json()
    assert np.abs(np.asarray(everything["outputs"]) - offline).max() <= 1e-5


def test_the_four_class_variant_serves_per_class_outputs(served: Served) -> None:
    build = served.use("four")
    assert build.model.num_classes == 4
    model_info = httpx.get(f"{served.url}/v1/model", timeout=30).json()
    assert (model_info["kind"], model_info["output_dim"]) == ("pmoe", 4)
    assert model_info["pmoe"]["layout"]["image"]["height"] == 32
    assert model_info["pmoe"]["num_classes"] == 4
    offline = predict_logits(build.model, build.x_test).numpy()
    answer = post_npy(served.url, "/v1/predict", flat(build)).json()
    outputs = np.asarray(answer["outputs"])
    assert outputs.shape == (len(build.y_test), 4)
    assert np.abs(outputs - offline).max() <= 1e-5
    accuracy = float((outputs.argmax(1) == build.y_test.numpy()).mean())
    assert accuracy == pytest.approx(build.report["expert_choice_accuracy"], abs=1e-6)
    assert accuracy > 0.25  # better than chance after a few epochs
    assert torch.equal(torch.as_tensor(outputs.argmax(1)), torch.as_tensor(offline.argmax(1)))

    # The SDK (which always sends top_k=1) gets the per-class outputs and the patch choices.
    with client.Client(served.url) as sdk:
        prediction = sdk.predict(flat(build)[:5], return_routing=True, return_stats=True)
    assert prediction.numpy().shape == (5, 4)
    assert prediction.patches is not None and prediction.stats is not None
    with torch.no_grad():
        expected = build.model.route(build.x_test[:5]).indices.tolist()
    assert [[e.patches for e in row] for row in prediction.patches] == expected
    assert prediction.stats.patches_computed == 5 * 4 * 2  # rows · k · l
