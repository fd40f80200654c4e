"""Hot swap in the deployment's shape: two Ray actors hold both CPUs of the cluster (as one
actor per GPU holds every GPU of a GPU node), and a new store version still goes live under
steady load, each request answered once and entirely by one version."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from live_support import LocalModel, build_store

from server import Settings, create_app

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

WATCH_INTERVAL_S = 0.5


@dataclass
class Answer:
    sent: float
    received: float
    status: int
    x: np.ndarray
    body: dict[str, object]


@asynccontextmanager
async def serving(store: Path, *, watch: bool) -> AsyncIterator[httpx.AsyncClient]:
    import ray

    settings = Settings(
        store=store,
        actors=2,
        cache_bytes=1 << 20,
        watch_store=watch,
        watch_interval_s=WATCH_INTERVAL_S,
        max_batch_wait_ms=1.0,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        # The shape under test: the actors took every CPU the cluster has (on a GPU machine,
        # one actor took the GPU).
        held = "GPU" if torch.cuda.is_available() else "CPU"
        assert ray.cluster_resources()[held] >= 1
        assert ray.available_resources().get(held, 0.0) == 0.0
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://momlp.test") as client:
            yield client


async def steady_load(
    client: httpx.AsyncClient, stop: asyncio.Event, answers: list[Answer], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        x = rng.normal(size=(int(rng.integers(1, 5)), 3))
        sent = time.monotonic()
        response = await client.post("/v1/predict", json={"inputs": x.tolist(), "mode": "exact"})
        answers.append(Answer(sent, time.monotonic(), response.status_code, x, response.json()))


def check_each_answer_is_one_versions(answers: list[Answer], models: dict[str, LocalModel]) -> None:
    """Every answer is a 200 whose experts and outputs are its own version's, row by row."""
    assert answers and all(a.status == 200 for a in answers), [a.body for a in answers[:3]]
    for answer in answers:
        model = models[str(answer.body["store_version"])]
        nearest, _ = model.nearest(answer.x, 1)
        experts = np.asarray(answer.body["experts"])
        np.testing.assert_array_equal(experts[:, 0], nearest[:, 0])
        expected = np.stack(
            [model.expert(int(e), answer.x[i : i + 1])[0] for i, e in enumerate(experts[:, 0])]
        )
        np.testing.assert_allclose(
            np.asarray(answer.body["outputs"]), expected, rtol=1e-5, atol=1e-6
        )


async def run_load_around(
    client: httpx.AsyncClient, swap: object, *, workers: int = 4
) -> tuple[list[Answer], float]:
    """Steady load from `workers` clients; `swap()` runs after 1 s of it. Returns the answers
    and when the new version was published."""
    answers: list[Answer] = []
    stop = asyncio.Event()
    load = [asyncio.create_task(steady_load(client, stop, answers, s)) for s in range(workers)]
    await asyncio.sleep(1.0)
    published = await swap()  # type: ignore[operator]
    deadline = time.monotonic() + WATCH_INTERVAL_S + 10.0
    while time.monotonic() < deadline and not any(
        a.sent > published and a.body.get("store_version") != answers[0].body["store_version"]
        for a in answers
    ):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # a little load on the new version too
    stop.set()
    await asyncio.gather(*load)
    return answers, published


async def test_a_republish_under_load_goes_live_within_the_watch_interval(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store", seed=0)
    old = LocalModel.open(store)
    async with serving(store, watch=True) as client:

        async def republish() -> float:
            await asyncio.to_thread(build_store, store, seed=1)
            return time.monotonic()

        answers, published = await run_load_around(client, republish)
    new = LocalModel.open(store)
    versions = {old.manifest["store_version"]: old, new.manifest["store_version"]: new}
    assert len(versions) == 2
    check_each_answer_is_one_versions(answers, versions)
    first_new = min(
        a.received for a in answers if a.body["store_version"] == new.manifest["store_version"]
    )
    assert first_new - published <= WATCH_INTERVAL_S + 2.0
    assert answers[-1].body["store_version"] == new.manifest["store_version"]


async def test_admin_reload_is_quick_when_unchanged_and_swaps_under_load(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store", seed=0)
    old = LocalModel.open(store)
    async with serving(store, watch=False) as client:
        started = time.monotonic()
        unchanged = await client.post("/v1/admin/reload")
        assert time.monotonic() - started < 1.0
        assert unchanged.status_code == 200 and unchanged.json()["reloaded"] is False

        async def republish_and_reload() -> float:
            await asyncio.to_thread(build_store, store, seed=2)
            published = time.monotonic()
            reload = await client.post("/v1/admin/reload")
            assert reload.status_code == 200 and reload.json()["reloaded"] is True
            return published

        answers, _ = await run_load_around(client, republish_and_reload)
    new = LocalModel.open(store)
    versions = {old.manifest["store_version"]: old, new.manifest["store_version"]: new}
    check_each_answer_is_one_versions(answers, versions)
    assert answers[-1].body["store_version"] == new.manifest["store_version"]
