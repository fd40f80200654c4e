"""POST /v1/admin/reload: the watcher's atomic swap on demand, guarded by the key or loopback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from app_support import (
    app_settings,
    build_small_store,
    error_of,
    expert_outputs,
    fake_pool,
    manifest,
    republish,
    running,
)

from server import create_app
from server.http import is_loopback

pytestmark = pytest.mark.unit


async def test_reload_returns_the_new_version_and_serves_it(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    old = manifest(store)["store_version"]
    app = create_app(app_settings(store), pool_factory=fake_pool)
    x = np.random.default_rng(1).normal(size=(16, 4)).astype(np.float32)
    async with running(app) as client:
        same = await client.post("/v1/admin/reload")
        assert same.status_code == 200
        assert same.json() == {"reloaded": False, "store_version": old, "previous_version": old}
        new = republish(store, seed=7)
        answer = await client.post("/v1/admin/reload")
        assert answer.status_code == 200
        assert answer.json() == {"reloaded": True, "store_version": new, "previous_version": old}
        predicted = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
        model = (await client.get("/v1/model")).json()
    assert predicted["store_version"] == new and model["store_version"] == new
    experts = np.asarray(predicted["experts"])[:, 0]
    expected = np.stack(
        [expert_outputs(store, int(e), x[i : i + 1])[0] for i, e in enumerate(experts)]
    )
    np.testing.assert_allclose(predicted["outputs"], expected, rtol=1e-5, atol=1e-6)


async def test_with_a_key_the_key_is_what_counts(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    app = create_app(app_settings(store, api_key="k3y"), pool_factory=fake_pool)
    async with running(app) as client:
        refused = await client.post("/v1/admin/reload")
        assert refused.status_code == 401
        assert error_of(refused)["code"] == "unauthorized"
    # A remote client with the key may reload.
    import httpx

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("198.51.100.7", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://momlp.test") as remote:
            answer = await remote.post("/v1/admin/reload", headers={"Authorization": "Bearer k3y"})
            assert answer.status_code == 200
            anonymous = await remote.post("/v1/admin/reload")
            assert anonymous.status_code == 401


async def test_without_a_key_a_remote_client_is_refused(tmp_path: Path) -> None:
    import httpx

    store = build_small_store(tmp_path / "store")
    app = create_app(app_settings(store), pool_factory=fake_pool)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("198.51.100.7", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://momlp.test") as remote:
            answer = await remote.post("/v1/admin/reload")
    assert answer.status_code == 403
    assert error_of(answer)["code"] == "forbidden"


async def test_a_broken_new_store_keeps_the_old_version_serving(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    old = manifest(store)["store_version"]
    app = create_app(app_settings(store), pool_factory=fake_pool)
    async with running(app) as client:
        (store / "manifest.json").write_text('{"store_version": "broken"')
        answer = await client.post("/v1/admin/reload")
        assert answer.status_code == 503
        error = error_of(answer)
        assert error["code"] == "reload_failed"
        assert error["detail"]["store_version"] == old
        still = await client.post("/v1/predict", json={"inputs": [[0.1, 0.2, 0.3, 0.4]]})
    assert still.status_code == 200
    assert still.json()["store_version"] == old


async def test_a_refused_reload_names_the_stores_files_not_the_servers_paths(
    tmp_path: Path,
) -> None:
    store = build_small_store(tmp_path / "store")
    router = manifest(store)["router_file"]
    app = create_app(app_settings(store), pool_factory=fake_pool)
    async with running(app) as client:
        elsewhere = tmp_path / "other-tenant"
        elsewhere.mkdir()
        (store / router).rename(elsewhere / router)
        (store / router).symlink_to(elsewhere / router)
        # A new version, so that the reload opens the store again.
        data = manifest(store)
        data["store_version"] = "v-linked"
        (store / "manifest.json").write_text(json.dumps(data))
        answer = await client.post("/v1/admin/reload")
    assert answer.status_code == 503
    reason = error_of(answer)["detail"]["reason"]
    assert reason == (
        f"bad manifest in the store: {router} is a link that leads outside the store"
    ), reason
    assert str(tmp_path) not in answer.text


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("localhost", False),
        ("", False),
        (None, False),
    ],
)
def test_is_loopback(host: str | None, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_refused_reloads_reason_cuts_the_store_folder_and_not_its_siblings() -> None:
    from server.http._admin import _store_named

    text = "bad manifest in /srv/store: /srv/store/router-1.safetensors; see /srv/store-old/x"
    assert _store_named(text, Path("/srv/store")) == (
        "bad manifest in the store: router-1.safetensors; see /srv/store-old/x"
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Forwarded", "for=203.0.113.9;proto=http"),
        ("X-Real-IP", "203.0.113.9"),
        ("X-Forwarded-For", "203.0.113.9"),
    ],
)
async def test_without_a_key_a_reload_relayed_by_a_proxy_on_this_machine_is_refused(
    tmp_path: Path, name: str, value: str
) -> None:
    # A proxy on this machine connects from loopback. uvicorn reads the client it names only
    # from X-Forwarded-For: behind one that sets Forwarded or X-Real-IP, every client
    # anywhere was taken for this machine and could reload.
    import httpx
    from loopback_support import serving_on_loopback

    store = build_small_store(tmp_path / "store")
    app = create_app(app_settings(store), pool_factory=fake_pool)
    async with serving_on_loopback(app) as url, httpx.AsyncClient(base_url=url) as client:
        relayed = await client.post("/v1/admin/reload", headers={name: value})
        direct = await client.post("/v1/admin/reload")
    assert relayed.status_code == 403, relayed.text
    assert error_of(relayed)["code"] == "forbidden"
    assert direct.status_code == 200, direct.text
