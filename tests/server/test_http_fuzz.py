"""Schema-based fuzzing: requests generated from /openapi.json never get a 5xx or hang.

Schemathesis generates requests for every operation (JSON and binary bodies, query
parameters) and sends them to the app in-process over ASGI, with the fake pool and a real
small store; about 1,200 requests in all.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from anyio.from_thread import BlockingPortal, start_blocking_portal
from app_support import build_small_store, fake_app, running
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    # input_dim 2 so that a fair share of generated rows have the right dimension.
    store = build_small_store(tmp_path_factory.mktemp("fuzz") / "store", K=8, n=2, width=8)
    app = fake_app(store, max_rows=64, max_body_bytes=1 << 16, request_timeout_s=10.0)
    yield app
    from schemathesis.python import asgi

    asgi.shutdown_lifespans()


@pytest.fixture(scope="module")
def api_schema(fuzz_app: FastAPI) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


# (method, path, examples): the body-taking operations get most of the ~1,000 requests.
OPERATIONS = [
    ("POST", "/v1/predict", 520),
    ("POST", "/v1/route", 480),
    ("GET", "/v1/model", 60),
    ("GET", "/v1/experts", 60),
    ("GET", "/healthz", 60),
    ("GET", "/readyz", 60),
    ("GET", "/metrics", 60),
]
SENT: dict[str, list[int]] = {}


@pytest.mark.parametrize(("method", "path", "examples"), OPERATIONS)
def test_generated_requests_never_get_a_server_error(
    api_schema: Any, method: str, path: str, examples: int
) -> None:
    strategy = api_schema[path][method].as_strategy()
    sent = SENT.setdefault(path, [])

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case: Any) -> None:
        response = case.call(timeout=10)
        sent.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, response.text[:500])
        if response.status_code >= 400:
            body = response.json()
            assert set(body) == {"error"} and {"code", "message", "detail"} == set(body["error"])

    check()


def test_the_fuzz_run_covered_enough_requests() -> None:
    # Runs after the fuzz tests (file order): at least 1,000 requests went out.
    counts = {path: len(codes) for path, codes in SENT.items()}
    assert sum(counts.values()) >= 1000, counts


class SyncClient:
    """A running app driven from synchronous (hypothesis) code through an event-loop thread."""

    def __init__(self, portal: BlockingPortal, client: httpx.AsyncClient) -> None:
        self.portal = portal
        self.client = client

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.portal.call(functools.partial(self.client.post, path, **kwargs))


@pytest.fixture(scope="module")
def model_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SyncClient]:
    store = build_small_store(tmp_path_factory.mktemp("models") / "store", K=8, n=2, width=8)
    context = running(fake_app(store, max_rows=64))
    with start_blocking_portal() as portal:
        client = portal.call(context.__aenter__)
        try:
            yield SyncClient(portal, client)
        finally:
            portal.call(context.__aexit__, None, None, None)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
rows_2d = st.lists(st.lists(finite, min_size=2, max_size=2), min_size=1, max_size=64)


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    inputs=rows_2d,
    top_k=st.one_of(st.none(), st.integers(min_value=1, max_value=10)),
    mode=st.sampled_from([None, "tree", "exact"]),
    return_stats=st.booleans(),
)
def test_well_shaped_requests_are_answered_or_refused_cleanly(
    model_client: SyncClient,
    inputs: list[list[float]],
    top_k: int | None,
    mode: str | None,
    return_stats: bool,
) -> None:
    body: dict[str, Any] = {"inputs": inputs, "return_stats": return_stats}
    if top_k is not None:
        body["top_k"] = top_k
    if mode is not None:
        body["mode"] = mode
    response = model_client.post("/v1/predict", json=body)
    k = top_k or 1
    if k > 8:
        assert response.status_code == 422
        return
    if response.status_code == 422:
        # Only inputs too large for float32 distances may be refused (the router's range check).
        assert max(abs(v) for row in inputs for v in row) > 1e15, response.text
        return
    assert response.status_code == 200, response.text
    answer = response.json()
    assert len(answer["outputs"]) == len(inputs)
    assert all(len(row) == k for row in answer["experts"])
    for weights in answer["weights"]:
        assert abs(sum(weights) - 1.0) < 1e-5
    assert (answer["stats"] is not None) == return_stats


# Schema-valid requests, every check schemathesis has: the schema states what the server
# enforces. JSON bodies only: OpenAPI cannot say that a binary body (npy, raw float32) holds a
# well-formed array, so arbitrary bytes are "schema-valid" there. For the v2 infer body, the
# same holds of a tensor's data length against its shape, so that one check is left out there.
# The last field: the share of generated requests that must be answered 2xx (random v2
# tensors almost never hold as many values as their shape says).
ALL_CHECKS_OPERATIONS = [
    ("POST", "/v1/predict", 150, (), 0.5),
    ("POST", "/v1/route", 100, (), 0.5),
    ("GET", "/v1/model", 20, (), 0.5),
    ("GET", "/v1/experts", 10, (), 0.5),
    ("GET", "/v2/models/{name}", 10, (), 0.5),
    ("GET", "/v2/models/{name}/ready", 10, (), 0.5),
    ("POST", "/v2/models/{name}/infer", 60, ("positive_data_acceptance",), 0.0),
]


@pytest.mark.parametrize(
    ("method", "path", "examples", "excluded", "answered"), ALL_CHECKS_OPERATIONS
)
def test_schema_valid_requests_pass_every_schemathesis_check(
    api_schema: Any,
    method: str,
    path: str,
    examples: int,
    excluded: tuple[str, ...],
    answered: float,
) -> None:
    from schemathesis.specs.openapi import checks

    strategy = api_schema[path][method].as_strategy().filter(
        lambda case: case.media_type in (None, "application/json")
    )
    skipped = [getattr(checks, name) for name in excluded]
    statuses: list[int] = []

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case: Any) -> None:
        response = case.call_and_validate(excluded_checks=skipped)
        statuses.append(response.status_code)

    check()
    # Not a run of refusals: schema-valid requests were answered.
    assert sum(code < 300 for code in statuses) >= answered * len(statuses), statuses
