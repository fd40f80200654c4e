"""Locust user that replays `momlp loadtest`'s request bodies against `POST /v1/predict`.

Run only as its own process (locust patches the standard library through gevent when it is
imported); `benchmarks/loadtest_vs_locust.py` writes the bodies and starts it:

    MOMLP_LOCUST_BODIES=bodies.jsonl MOMLP_LOCUST_OUT=out.json \\
        locust -f benchmarks/locustfile.py --headless -u 8 -r 1000 --host http://127.0.0.1:8000

`MOMLP_LOCUST_BODIES`: one JSON request body a line, sent in file order (closed loop: each user
sends its next body as soon as its previous answer is read). `MOMLP_LOCUST_API_KEY`: bearer
key, if any. When every body has been answered, the run stops and `MOMLP_LOCUST_OUT` receives
one record per request: [start_s, latency_ms, status], with start_s on one clock for the run.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import gevent
from locust import HttpUser, constant, events, task
from locust.exception import StopUser

_BODIES: deque[bytes] = deque(
    line.encode()
    for line in Path(os.environ["MOMLP_LOCUST_BODIES"]).read_text().splitlines()
    if line
)
_TOTAL = len(_BODIES)
_RECORDS: list[tuple[float, float, int]] = []
_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
if os.environ.get("MOMLP_LOCUST_API_KEY"):
    _HEADERS["Authorization"] = f"Bearer {os.environ['MOMLP_LOCUST_API_KEY']}"


@events.request.add_listener
def _record(response_time: float, response: Any = None, **_: Any) -> None:
    # Locust's own latency (request sent to body read); the start is recovered from it.
    end = time.perf_counter()
    status = getattr(response, "status_code", 0) or 0
    _RECORDS.append((end - response_time / 1000.0, response_time, int(status)))


@events.test_stop.add_listener
def _write(**_: Any) -> None:
    Path(os.environ["MOMLP_LOCUST_OUT"]).write_text(
        json.dumps({"total": _TOTAL, "records": _RECORDS})
    )


class MomlpUser(HttpUser):
    wait_time = constant(0)

    @task
    def predict(self) -> None:
        if not _BODIES:
            raise StopUser()
        body = _BODIES.popleft()
        # name= keeps one stats line; catch_response is not needed: non-2xx counts as failure.
        self.client.post("/v1/predict", data=body, headers=_HEADERS, name="/v1/predict")
        if len(_RECORDS) >= _TOTAL:
            # quit() stops every user greenlet, this one too: called inline it can be cut off
            # before the runner has quit (seen as a hang), so it runs in a greenlet of its own.
            gevent.spawn(self.environment.runner.quit)
            raise StopUser()
