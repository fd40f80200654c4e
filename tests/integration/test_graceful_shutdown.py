"""Stopping a real uvicorn server lets a request in flight finish before the pool is closed."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import httpx
import pytest
from live_support import GatedPool, build_store, wait_until

pytestmark = pytest.mark.integration


def _refuses_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


def test_in_flight_request_finishes_before_the_pool_closes(tmp_path: Path) -> None:
    import uvicorn

    from server import FakeExpertPool, Settings, create_app

    store = build_store(tmp_path / "store")
    pools: list[GatedPool] = []

    def factory(settings: Settings) -> GatedPool:
        pools.append(GatedPool(FakeExpertPool(settings)))
        return pools[-1]

    settings = Settings(store=store, port=0, watch_store=False, cache_bytes=1 << 20)
    app = create_app(settings, pool_factory=factory)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, timeout_graceful_shutdown=30)
    )
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    wait_until(lambda: server.started or not serving.is_alive(), 60.0, "server start")
    port = server.servers[0].sockets[0].getsockname()[1]

    answers: list[httpx.Response] = []

    def ask() -> None:
        answers.append(
            httpx.post(
                f"http://127.0.0.1:{port}/v1/predict",
                json={"inputs": [[0.1, 0.2, 0.3]]},
                timeout=60,
            )
        )

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        assert pools[0].entered.wait(timeout=60)
        server.should_exit = True  # what SIGTERM / Ctrl-C does
        # Shutdown has begun once the listening socket is closed; the request is still held.
        wait_until(lambda: _refuses_connections(port), 30.0, "listening socket closed")
        assert pools[0].events == []
        pools[0].open_gate()
        asking.join(timeout=60)
        serving.join(timeout=60)
    finally:
        if pools and not pools[0].events:
            pools[0].open_gate()
        server.should_exit = True
        serving.join(timeout=60)
    assert not serving.is_alive()
    assert [a.status_code for a in answers] == [200]
    assert pools[0].events == ["answered", "closed"]
