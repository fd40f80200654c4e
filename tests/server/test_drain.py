"""The drain window: a first stop signal is put off while the readiness probes say 503."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from app_support import error_of, fake_app, running

from server._drain import DrainWindow

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_no_window_stops_at_the_first_signal() -> None:
    begun: list[bool] = []
    drain = DrainWindow(0.0, lambda: begun.append(True))
    assert not drain.ask() and not drain.due() and begun == []


def test_the_first_signal_opens_the_window_and_the_second_stops_now() -> None:
    clock, begun = Clock(), []
    drain = DrainWindow(5.0, lambda: begun.append(clock.t), clock)
    assert not drain.due()  # nothing asked yet
    assert drain.ask()
    assert begun == []  # opened from the loop's tick, not inside the signal handler
    clock.t = 101.0
    assert not drain.due() and begun == [101.0]
    clock.t = 105.9
    assert not drain.due()
    clock.t = 106.0
    assert drain.due() and begun == [101.0]
    assert not drain.ask()  # a second signal: stop now


async def test_draining_makes_both_readiness_probes_503_while_predictions_are_answered(
    make_store: Any,
) -> None:
    store: Path = make_store(K=8, n=4, width=16, out=2)
    app = fake_app(store)
    async with running(app) as client:
        assert (await client.get("/readyz")).status_code == 200
        app.state.serving.draining = True
        ready = await client.get("/readyz")
        v2_ready = await client.get("/v2/health/ready")
        answer = await client.post("/v1/predict", json={"inputs": [[0.1, 0.2, 0.3, 0.4]]})
        live = await client.get("/healthz")
    assert ready.status_code == 503 and error_of(ready)["code"] == "not_ready"
    assert "draining" in error_of(ready)["message"]
    assert v2_ready.status_code == 503 and "draining" in v2_ready.json()["error"]
    assert answer.status_code == 200 and live.status_code == 200
