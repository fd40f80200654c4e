"""A real uvicorn on 127.0.0.1 (a free port) in a thread, for tests whose clients are
synchronous (tritonclient, the sync SDK) or run their own event loop."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

__all__ = ["serving_in_thread"]


@contextlib.contextmanager
def serving_in_thread(app: Any, name: str = "momlp-test-uvicorn") -> Iterator[str]:
    """uvicorn serving `app` (its lifespan included) until the block ends; the base URL."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on")
    )
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
