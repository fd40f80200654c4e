"""`momlp demo --ray-address` checks (and waits for) its Ray head before it starts Ray for the
build, as `momlp serve` does: ray.init waited ~14 minutes for a head that was not there, and
answered a malformed address with a traceback, before the demo's build began."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from app_support import build_small_store

import server._runner
import server.pool
import trainer
from server._cli import main

pytestmark = pytest.mark.unit


@pytest.fixture
def entered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """What the demo went on to: Ray (for the build), the build, the server."""
    steps: list[str] = []

    @contextlib.contextmanager
    def ray_session(**kwargs: Any) -> Iterator[bool]:
        steps.append("ray")
        yield False

    def build(config: Any, **kwargs: Any) -> None:
        steps.append("build")
        build_small_store(Path(config.out))

    def serve(settings: Any) -> int:
        steps.append("serve")
        return 0

    monkeypatch.setattr(server.pool, "ray_session", ray_session)
    monkeypatch.setattr(trainer, "build_store", build)
    monkeypatch.setattr(server._runner, "run_server", serve)
    monkeypatch.chdir(tmp_path)  # no demo-store here: the demo builds one
    return steps


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_demo_whose_ray_head_never_answers_stops_before_ray_and_the_build(
    entered: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    port = _closed_port()
    code = main(["demo", "--port", "0", "--ray-address", f"127.0.0.1:{port}",
                 "--ray-connect-wait-s", "0"])
    assert code == 1
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in caplog.text
    assert entered == []


def test_a_demo_with_a_malformed_ray_address_is_refused_before_ray(entered: list[str]) -> None:
    assert main(["demo", "--port", "0", "--ray-address", "http://127.0.0.2:6390"]) == 2
    assert entered == []


def test_a_demo_whose_ray_head_answers_builds_then_serves(entered: list[str]) -> None:
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        port = head.getsockname()[1]
        code = main(["demo", "--port", "0", "--ray-address", f"127.0.0.1:{port}"])
    assert (code, entered) == (0, ["ray", "build", "serve"])
