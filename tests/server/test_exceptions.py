"""server/_exceptions.py: one tree, all of it public, each answered with its own status."""

from __future__ import annotations

import json

import pytest

import server
import server._exceptions as tree
from server.http._errors import error_response

pytestmark = pytest.mark.unit


def test_every_error_of_the_tree_is_a_server_error_exported_by_server() -> None:
    # Four of them were importable only from the private module, and the HTTP layer's own
    # error stood beside the tree rather than in it.
    for name in tree.__all__:
        cls = getattr(tree, name)
        assert issubclass(cls, tree.ServerError), name
        assert getattr(server, name) is cls, name
        assert name in server.__all__, name


def test_an_http_error_is_answered_with_its_own_status_code_and_headers() -> None:
    exc = tree.HttpError(415, "unsupported_media_type", "not JSON", detail={"media": "x"},
                         headers={"Accept": "application/json"})
    response = error_response(exc, "/v1/predict")
    assert response.status_code == 415 and response.headers["Accept"] == "application/json"
    assert json.loads(bytes(response.body)) == {"error": {
        "code": "unsupported_media_type", "message": "not JSON", "detail": {"media": "x"}}}
