"""The bearer key as an operator sets it and a client sends it: whitespace around it, a blank
one, one beyond ASCII."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from app_support import app_settings, build_small_store, error_of, fake_pool

from server import create_app
from server._runner import open_without_key

pytestmark = pytest.mark.unit

REMOTE = ("198.51.100.7", 1234)


async def _answers(
    store: Path, api_key: str, requests: list[tuple[str, str, dict[bytes, bytes]]]
) -> list[httpx.Response]:
    """The app with `api_key` answering `requests` (method, path, headers) from off this
    machine, in order."""
    app = create_app(app_settings(store, api_key=api_key), pool_factory=fake_pool)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=REMOTE)
        async with httpx.AsyncClient(transport=transport, base_url="http://momlp.test") as client:
            return [
                await client.request(method, path, headers=headers)
                for method, path, headers in requests
            ]


@pytest.mark.parametrize("key", ["s3cret\n", " s3cret", "s3cret\r\n"])
async def test_a_key_read_with_whitespace_around_it_is_matched_by_the_key(
    tmp_path: Path, key: str
) -> None:
    # A key from a file or a Kubernetes secret often ends in a newline, which no header can
    # carry: every client was refused for good.
    store = build_small_store(tmp_path / "store")
    good, wrong, none = await _answers(
        store,
        key,
        [
            ("GET", "/v1/model", {b"Authorization": b"Bearer s3cret"}),
            ("GET", "/v1/model", {b"Authorization": b"Bearer s3cre"}),
            ("GET", "/v1/model", {}),
        ],
    )
    assert good.status_code == 200, good.text
    assert wrong.status_code == 401 and none.status_code == 401
    assert error_of(wrong)["code"] == "unauthorized"


async def test_a_key_beyond_ascii_is_matched_as_the_client_sends_it_utf8(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    key = "pässwörd-✓"
    utf8, latin1 = await _answers(
        store,
        key,
        [
            ("GET", "/v1/model", {b"Authorization": b"Bearer " + key.encode("utf-8")}),
            ("GET", "/v1/model", {b"Authorization": b"Bearer " + "pässwörd".encode("latin-1")}),
        ],
    )
    assert utf8.status_code == 200, utf8.text
    assert latin1.status_code == 401


@pytest.mark.parametrize("blank", ["", "   ", "\n"])
async def test_a_blank_key_is_no_key_so_reloads_stay_on_this_machine(
    tmp_path: Path, blank: str
) -> None:
    # MOMLP_API_KEY= (empty) was a key that `Authorization: Bearer` matched: anyone anywhere
    # could reload, while the start-up warning said reloads stayed on this machine.
    store = build_small_store(tmp_path / "store")
    reload, reload_bearer, model = await _answers(
        store,
        blank,
        [
            ("POST", "/v1/admin/reload", {}),
            ("POST", "/v1/admin/reload", {b"Authorization": b"Bearer"}),
            ("GET", "/v1/model", {}),
        ],
    )
    for refused in (reload_bearer, reload):
        assert refused.status_code == 403, refused.text
        assert error_of(refused)["code"] == "forbidden"
    assert model.status_code == 200, model.text
    settings = app_settings(store, api_key=blank, host="0.0.0.0")
    assert open_without_key(settings)  # and `momlp serve` warns that it is open
