"""The actors' socket folder holds one socket per actor however often they restart: a killed
process never removed its own, so the folder gained a file a restart for the server's life."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pool_support import IdGroup, IdPool, expected

from experts_store import Store
from server._settings import Settings
from server.pool import RayExpertPool

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

MakeStore = Callable[..., Path]


async def test_a_restarted_actor_leaves_no_socket_of_its_killed_process(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=8, n=2, width=8, out=1))
    settings = Settings(actors=2, cache_bytes=10**7, actor_channel="socket")
    inner = await asyncio.to_thread(RayExpertPool.create, settings)
    pool = IdPool(store, inner)
    groups = [IdGroup(e, torch.ones(2, 2)) for e in range(8)]
    try:
        folder = inner._channel_dir
        assert folder is not None
        await pool.run(groups)  # each actor opens its socket
        for _ in range(2):
            os.kill(await inner.handle("actor-0").get_pid.remote(), signal.SIGKILL)
            await pool.run(groups)  # notices the death; actor-1 answers
            assert await pool.wait_until_alive("actor-0")
            results = await pool.run(groups)  # the restarted process opens its own
            assert "actor-0" in {result.actor for result in results}
        for group, result in zip(groups, results, strict=True):
            torch.testing.assert_close(result.outputs, expected(store, group))
        pid0 = await inner.handle("actor-0").get_pid.remote()
        pid1 = await inner.handle("actor-1").get_pid.remote()
        assert sorted(path.name for path in folder.iterdir()) == [
            f"actor-0-{pid0}.sock", f"actor-1-{pid1}.sock"
        ]
    finally:
        await pool.close()
