"""A server that hot-swaps store versions for weeks holds the versions it serves, not every
version it ever served.

A swap of a large store freezes what is alive at the end of its open (server/serving/
_collect.py): from then on the cyclic collector never frees those objects, only reference
counting does. A retired version caught in a reference cycle then stayed for the server's
life, its router, manifest and model with it, one more at every swap.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
from app_support import app_settings, build_small_store, fake_pool, republish, running

import server.serving._state as serving_state
from server import create_app
from server.serving import ServingState

pytestmark = pytest.mark.unit


async def test_retired_versions_are_freed_though_each_swap_freezes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every swap freezes, as the swap of a store of some 4,000 experts or more does.
    monkeypatch.setattr(serving_state, "SWAP_FREEZE_FROM_OBJECTS", 0)
    store = build_small_store(tmp_path / "store")
    app = create_app(app_settings(store), pool_factory=fake_pool)
    x = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    served: list[weakref.ref[object]] = []
    async with running(app) as client:
        serving: ServingState = app.state.serving
        for seed in range(20):
            answer = await client.post("/v1/predict", json={"inputs": x.tolist()})
            assert answer.status_code == 200
            assert serving.version is not None
            # Its model: the router, manifest and gate a version serves with.
            served.append(weakref.ref(serving.version.model))
            republish(store, seed=100 + seed)
            assert await serving.reload()  # waits until the replaced version has drained
        await client.post("/v1/predict", json={"inputs": x.tolist()})
        gc.collect()
        alive = sum(ref() is not None for ref in served)
    # The version served now is not among them; the one it replaced may still be retiring.
    assert alive <= 1, f"the models of {alive} of {len(served)} replaced versions are kept"
