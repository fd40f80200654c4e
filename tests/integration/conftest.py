"""A real momlp server (uvicorn on a loopback port, Ray actors) over a small real store."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from live_support import LiveServer, LocalModel, build_store, wait_until


@pytest.fixture(scope="module")
def live_server(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """uvicorn in a background thread, the default (Ray) pool, the session's Ray."""
    import uvicorn

    from server import Settings, create_app

    store = build_store(tmp_path_factory.mktemp("live") / "store")
    settings = Settings(
        store=store, port=0, actors=2, cache_bytes=1 << 20, watch_store=False, max_rows=512
    )
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="momlp-uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 120.0, "server start")
    if not server.started:
        raise RuntimeError("the server failed to start (see the log)")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", store, LocalModel.open(store))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
