"""The least an HTTP JSON predict server does, as a bare ASGI app (for `http_floor.py`).

It reads the body, parses its JSON and answers with a body shaped like momlp's answer with
`return_stats` (a row of FLOOR_OUTPUT_DIM zeros per input row; one cache hit): no
validation, routing or experts.
Served by uvicorn as momlp is, it is the floor of what any server built on uvicorn pays per
request on this machine.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["app"]

_HEADERS = [(b"content-type", b"application/json")]
_WIDTH = int(os.environ.get("FLOOR_OUTPUT_DIM", "1"))


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    try:
        rows = json.loads(body)["inputs"]
        outputs = [[0.0] * _WIDTH for _ in rows]
    except (ValueError, KeyError, TypeError):
        await send({"type": "http.response.start", "status": 422, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": b'{"error":"bad body"}'})
        return
    answer = {
        "outputs": outputs,
        "stats": {"experts": [{"cache": "hit"}], "device_bytes": {}},
    }
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
