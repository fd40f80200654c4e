from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest

from server._exceptions import InvalidRequest
from server._settings import Settings
from server.kinds import GateRequest
from server.serving import StoreVersion

pytestmark = pytest.mark.unit


class CountingModel:
    """A kind whose resolve counts its calls and refuses top_k = 9."""

    def __init__(self) -> None:
        self.calls = 0

    def resolve(self, request: GateRequest, settings: Settings) -> Hashable:
        self.calls += 1
        if request.top_k == 9:
            raise InvalidRequest("top_k=9 is refused", field="top_k")
        return ("gate", request.top_k, settings.default_top_k)


def version(model: Any) -> StoreVersion:
    return StoreVersion(store=None, model=model, batcher=None, route_runner=None)  # type: ignore[arg-type]


def test_a_version_resolves_each_request_gate_once_and_never_keeps_a_refusal() -> None:
    model, settings = CountingModel(), Settings()
    served = version(model)
    first = served.resolve(GateRequest(top_k=2), settings)
    assert served.resolve(GateRequest(top_k=2), settings) == first == ("gate", 2, 1)
    assert model.calls == 1
    assert served.resolve(GateRequest(), settings) == ("gate", None, 1)
    assert model.calls == 2
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="top_k=9"):
            served.resolve(GateRequest(top_k=9), settings)
    assert model.calls == 4
