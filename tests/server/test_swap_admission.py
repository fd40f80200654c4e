"""Admission against `max_queue_rows` across a hot swap (server/serving/_state.py, the
batcher's `queued_elsewhere`): a request keeps the version it entered, so after a swap two
batchers hold rows, and each one's admission counts the other's once, never its own twice.
Real uvicorn on loopback, driven with httpx."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from app_support import BlockingPool, app_settings, build_small_store, republish
from test_connections import serving

from server import Settings, create_app
from server.pool import ExpertPool, FakeExpertPool

pytestmark = pytest.mark.unit


def _body(rows: int, seed: int) -> bytes:
    x = np.random.default_rng(seed).normal(size=(rows, 4)).tolist()
    return httpx.Request("POST", "http://x", json={"inputs": x}).read()


async def test_a_request_that_entered_the_replaced_version_is_not_refused_for_its_own_rows(
    tmp_path: Path,
) -> None:
    # The replaced version's batcher counted the rows of every replaced version, its own
    # among them: its own 5 queued rows read as 10, and a 3-row request whose body arrived
    # after the swap got 429 "(10 of 8 rows)" with 5 rows queued in the whole server.
    store = build_small_store(tmp_path / "store")
    pools: list[BlockingPool] = []

    def blocking(settings: Settings) -> ExpertPool:
        pools.append(BlockingPool(FakeExpertPool(settings)))
        return pools[-1]

    app = create_app(app_settings(store, max_queue_rows=8), pool_factory=blocking)
    body_may_end = asyncio.Event()
    late_body = _body(3, seed=2)

    async def slow_body() -> AsyncIterator[bytes]:
        await body_may_end.wait()
        yield late_body

    async with serving(app, header_timeout_s=30.0) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            headers = {"Content-Type": "application/json"}
            first = asyncio.create_task(
                client.post("/v1/predict", content=_body(5, seed=0), headers=headers)
            )
            await pools[0].entered.wait()
            old = app.state.serving.version
            late = asyncio.create_task(client.post(
                "/v1/predict", content=slow_body(),
                headers={**headers, "Content-Length": str(len(late_body))},
            ))
            for _ in range(3000):  # the late request has entered the version it will keep
                if old.in_flight == 2:
                    break
                await asyncio.sleep(0.01)
            assert old.in_flight == 2
            republish(store, seed=1)
            assert (await client.post("/v1/admin/reload")).json()["reloaded"]
            assert app.state.serving.version is not old
            body_may_end.set()
            for _ in range(3000):  # admitted (its rows queued) or answered
                if old.batcher.queued_rows == 8 or late.done():
                    break
                await asyncio.sleep(0.01)
            pools[0].gate.set()
            answers = [await first, await late]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert len(answers[1].json()["outputs"]) == 3
