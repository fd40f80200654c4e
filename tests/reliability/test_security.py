"""Security: the key guards every endpoint but the health probes, requests never name a file,
nothing is unpickled, and the server binds loopback by default."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.routing import APIRoute
from reliability_support import N, fake_app, publish_store, running
from starlette.routing import Route

from server import Settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
KEY = "s3cret-key"
# Open with a key set: an orchestrator's HTTP probe cannot send one.
PROBES = {"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"}


def _endpoints(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, FastAPI's own (/docs...) included."""
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute | Route):
            for method in sorted(route.methods or {"GET"}):
                if method != "HEAD":
                    found.append((method, route.path))
    return found


async def test_the_key_is_required_on_every_endpoint_but_the_probes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish_store(store)
    app = fake_app(store, api_key=KEY)
    endpoints = _endpoints(app)
    paths = {path for _, path in endpoints}
    # The walk must see the whole API, not an empty list.
    assert {"/v1/predict", "/v1/route", "/v1/experts", "/v1/admin/reload", "/metrics"} <= paths
    body = {"inputs": [[0.0] * N]}
    async with running(app) as client:
        for method, path in endpoints:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                answer = await client.request(method, path, json=body, headers=headers)
                if path in PROBES:
                    assert answer.status_code == 200, (method, path)
                else:
                    assert answer.status_code == 401, (method, path, headers, answer.text)
                    assert answer.headers["www-authenticate"] == "Bearer"
                    assert KEY not in answer.text
            good = await client.request(
                method, path, json=body, headers={"Authorization": f"Bearer {KEY}"}
            )
            assert good.status_code != 401, (method, path)


async def test_admin_reload_without_a_key_is_for_loopback_clients_only(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish_store(store)
    app = fake_app(store)
    async with running(app, client=("203.0.113.9", 40000)) as remote:
        refused = await remote.post("/v1/admin/reload")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "forbidden"
        # Everything else stays open without a key.
        assert (await remote.get("/v1/model")).status_code == 200
    async with running(fake_app(store), client=("::1", 40000)) as local:
        assert (await local.post("/v1/admin/reload")).status_code == 200


_PATHS = [
    "../../../../etc/passwd",
    "/etc/passwd",
    "experts/0.safetensors",
    "manifest.json",
    "file:///etc/passwd",
    "..\\..\\windows\\win.ini",
    "%2e%2e%2fetc%2fpasswd",
]


@pytest.fixture
def opened_files() -> Iterator[list[str]]:
    """Paths this process opens while the test runs (an audit hook: sees every open())."""
    seen: list[str] = []
    _AUDIT.append(seen)
    try:
        yield seen
    finally:
        _AUDIT.remove(seen)


_AUDIT: list[list[str]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _AUDIT and isinstance(args[0], str | bytes | Path):
        for seen in _AUDIT:
            seen.append(str(args[0]))


# Audit hooks cannot be removed; this one only records while a test holds `opened_files`.
sys.addaudithook(_audit)


async def test_path_like_strings_in_any_field_get_422_and_open_nothing(
    tmp_path: Path, opened_files: list[str]
) -> None:
    store = tmp_path / "store"
    publish_store(store)
    app = fake_app(store)
    row = [0.5] * N
    async with running(app) as client:
        before = len(opened_files)
        answers = []
        for text in _PATHS:
            bodies: list[dict[str, Any]] = [
                {"inputs": text},
                {"inputs": [text]},
                {"inputs": [[text] * N]},
                {"inputs": [row], "top_k": text},
                {"inputs": [row], "mode": text},
                {"inputs": [row], "return_stats": text},
                {"inputs": [row], "file": text},
                {"inputs": [row], "store": text},
                {"inputs": [row], "expert_id": text},
                {"inputs": [row], "experts": [text]},
            ]
            for body in bodies:
                for path in ("/v1/predict", "/v1/route"):
                    answers.append((path, body, await client.post(path, json=body)))
            raw = np.zeros((1, N), dtype=np.float32).tobytes()
            for params in ({"mode": text}, {"top_k": text}, {"return_stats": text}):
                answers.append(
                    (
                        "raw",
                        params,
                        await client.post(
                            "/v1/predict",
                            content=raw,
                            params=params,
                            headers={
                                "Content-Type": "application/octet-stream",
                                "X-Momlp-Rows": "1",
                            },
                        ),
                    )
                )
            answers.append(
                (
                    "rows-header",
                    text,
                    await client.post(
                        "/v1/predict",
                        content=raw,
                        headers={"Content-Type": "application/octet-stream", "X-Momlp-Rows": text},
                    ),
                )
            )
        opened = opened_files[before:]
    for where, body, answer in answers:
        assert answer.status_code == 422, (where, body, answer.text)
    # No file was opened while refusing them: no store file, nothing a client named. (A lazy
    # module import reads Python files; those are not request data and are left out.)
    assert [p for p in opened if not p.endswith((".py", ".pyc", ".so"))] == [], opened


def test_no_source_file_unpickles() -> None:
    pattern = re.compile(
        r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill|joblib)\b"
        r"|pickle\.loads?\(|torch\.load\(|allow_pickle\s*=\s*True|weights_only\s*=\s*False",
        re.MULTILINE,
    )
    packages = ["experts_store", "router", "trainer", "server", "client", "benchmarks"]
    sources = [p for package in packages for p in sorted((REPO / package).rglob("*.py"))]
    assert len(sources) > 20
    offenders = [
        f"{path.relative_to(REPO)}: {match.group(0).strip()}"
        for path in sources
        for match in pattern.finditer(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_default_bind_is_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOMLP_HOST", raising=False)
    assert Settings().host == "127.0.0.1"
