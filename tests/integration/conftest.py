"""A real momlp server (uvicorn on a loopback port, Ray actors) over a small real store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_support import LiveServer, LocalModel, build_store, serve_app


@pytest.fixture(scope="module")
def live_server(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """uvicorn in a background thread, the default (Ray) pool, the session's Ray."""
    from server import Settings, create_app

    store = build_store(tmp_path_factory.mktemp("live") / "store")
    settings = Settings(
        store=store, port=0, actors=2, cache_bytes=1 << 20, watch_store=False, max_rows=512
    )
    with serve_app(create_app(settings)) as url:
        yield LiveServer(url, store, LocalModel.open(store))
