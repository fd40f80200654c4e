"""Client and AsyncClient against the fake server: same behaviour, parametrized over both."""

from __future__ import annotations

import inspect
import json
import math
from typing import Any

import httpx
import numpy as np
import pytest

import client
from client import AsyncClient, Client

pytestmark = pytest.mark.unit


class Under:
    """One client of either flavour; `await under.call("predict", ...)` works for both."""

    def __init__(self, kind: str, handler: Any, **kwargs: Any) -> None:
        self.kind = kind
        self.sleeps: list[float] = []
        transport = httpx.MockTransport(handler)
        if kind == "sync":
            self.client: Client | AsyncClient = Client(
                transport=transport, sleep=self.sleeps.append, **kwargs
            )
        else:

            async def sleep(seconds: float) -> None:
                self.sleeps.append(seconds)

            self.client = AsyncClient(transport=transport, sleep=sleep, **kwargs)

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.client, name)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def close(self) -> None:
        if isinstance(self.client, Client):
            self.client.close()
        else:
            await self.client.aclose()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def under(kind, fake_server):
    made: list[Under] = []

    def make(handler: Any = None, **kwargs: Any) -> Under:
        kwargs.setdefault("rng", __import__("random").Random(0))
        made.append(Under(kind, handler or fake_server.handler, **kwargs))
        return made[-1]

    yield make
    for one in made:
        await one.close()


def expected_output(prototypes, row, top_k=1, temperature=1.0):
    d = [math.dist(row, p) for p in prototypes]
    order = sorted(range(len(d)), key=lambda i: (d[i], i))[:top_k]
    w = np.exp([-(d[i] ** 2) / temperature for i in order])
    w = w / w.sum()
    return order, float(sum(wi * sum(row) * (e + 1) for e, wi in zip(order, w, strict=True)))


async def test_predict_returns_outputs_experts_and_stats(under, fake_server):
    rows = [[0.1, 0.2], [2.9, 3.1], [1.2, 0.1]]
    prediction = await under().call("predict", rows, return_stats=True)
    assert isinstance(prediction, client.Prediction)
    for row, out, experts in zip(rows, prediction.outputs, prediction.experts, strict=True):
        order, value = expected_output(fake_server.prototypes, row)
        assert experts == order
        assert out[0] == pytest.approx(value)
    stats = prediction.stats
    assert stats is not None
    assert stats.misses == 3 and stats.hits == 0
    assert stats.vram_bytes == max(s.vram_bytes for s in stats.experts)
    assert stats.device_bytes == {"actor-0": sum(fake_server.cache.values())}
    assert prediction.numpy().shape == (3, 1)
    assert prediction.numpy().dtype == np.float32


async def test_top_k_weights_follow_the_softmax_gate(under, fake_server):
    row = [1.4, 1.6]
    prediction = await under().call("predict", [row], top_k=3)
    order, value = expected_output(fake_server.prototypes, row, top_k=3)
    assert prediction.experts == [order]
    assert sum(prediction.weights[0]) == pytest.approx(1.0)
    assert prediction.outputs[0][0] == pytest.approx(value)
    assert prediction.stats is None


@pytest.mark.parametrize(
    "inputs",
    [
        ((0.5, 0.5), (1.5, 2.5)),
        np.array([[0.5, 0.5], [1.5, 2.5]], dtype=np.float32),
        np.array([[0.5, 0.5], [1.5, 2.5]], dtype=np.float64),
        [np.array([0.5, 0.5]), np.array([1.5, 2.5])],
        np.array([[0, 0], [1, 2]], dtype=np.int64),
    ],
    ids=["tuples", "float32", "float64", "list-of-arrays", "int64"],
)
async def test_predict_accepts_array_likes(under, fake_server, inputs):
    prediction = await under().call("predict", inputs)
    expected = [expected_output(fake_server.prototypes, list(map(float, r)))[1] for r in inputs]
    assert [o[0] for o in prediction.outputs] == pytest.approx(expected)
    assert fake_server.content_types == ["application/json"]


async def test_big_numpy_batches_travel_as_npy_with_the_same_answer(under, fake_server):
    rng = np.random.default_rng(0)
    batch = rng.uniform(0, 3, size=(300, 2)).astype(np.float32)
    one = under(binary_min_values=500)
    as_npy = await one.call("predict", batch, return_stats=True)
    as_json = await one.call("predict", batch, return_stats=True, binary=False)
    assert fake_server.content_types == ["application/x-npy", "application/json"]
    assert as_npy.outputs == as_json.outputs
    assert as_npy.stats is not None and as_npy.stats.hits + as_npy.stats.misses > 0


async def test_binary_true_sends_npy_even_for_lists(under, fake_server):
    prediction = await under().call("predict", [[0.5, 0.5]], binary=True, top_k=2, mode="exact")
    assert fake_server.content_types == ["application/x-npy"]
    assert len(prediction.experts[0]) == 2


async def test_route_model_experts_probes_and_metrics(under, fake_server):
    one = under()
    routing = await one.call("route", [[0.1, 0.0], [3.0, 2.9]], top_k=2)
    assert [e[0] for e in routing.experts] == [0, 15]
    assert routing.distances[0][0] == pytest.approx(math.dist([0.1, 0.0], [0.0, 0.0]))
    model = await one.call("model")
    assert model.prototypes is None and model.num_experts == 16
    model = await one.call("model", include_prototypes=True)
    assert model.prototypes == fake_server.prototypes
    assert model.total_expert_bytes == fake_server.total_expert_bytes
    await one.call("predict", [[0.0, 0.0]])
    experts = await one.call("experts")
    assert experts.experts[0].actors == ["actor-0"] and experts.experts[1].actors == []
    assert experts.actors[0].resident == [0]
    assert await one.call("health") is True
    assert await one.call("ready") is True
    assert "momlp_cache_misses_total 1" in await one.call("metrics")


async def test_api_key_is_sent_as_bearer(under, make_server):
    server = make_server(api_key="s3cret")
    assert (await under(server.handler, api_key="s3cret").call("predict", [[0, 0]])).outputs
    with pytest.raises(client.Unauthorized) as caught:
        await under(server.handler, api_key="wrong").call("predict", [[0, 0]])
    assert caught.value.status_code == 401 and caught.value.code == "unauthorized"
    with pytest.raises(client.Unauthorized):
        await under(server.handler).call("ready")


@pytest.mark.parametrize(
    ("status", "code", "detail", "cls"),
    [
        (422, "invalid_input", None, client.InvalidInput),
        (413, "payload_too_large", {"max_rows": 8}, client.PayloadTooLarge),
        (404, "not_found", None, client.NotFound),
        (429, "pool_saturated", None, client.RateLimited),
        (503, "not_ready", None, client.ServiceUnavailable),
        (
            503,
            "expert_unavailable",
            {"expert_id": 7, "reason": "checksum"},
            client.ExpertUnavailable,
        ),
        (500, "internal", None, client.ServerError),
        (504, "timeout", None, client.ServerError),
        (405, "method_not_allowed", None, client.HTTPStatusError),
        (415, "unsupported_media_type", None, client.HTTPStatusError),
    ],
)
async def test_error_bodies_map_to_one_class_each(under, make_error, status, code, detail, cls):
    response = make_error(status, code, "told you", detail, **{"Retry-After": "2"})
    with pytest.raises(cls) as caught:
        await under(lambda request: response, max_retries=0).call("predict", [[0, 0]])
    error = caught.value
    assert type(error) is cls
    assert (error.status_code, error.code, error.message, error.detail) == (
        status,
        code,
        "told you",
        detail,
    )
    assert error.retry_after == 2.0
    if cls is client.ExpertUnavailable:
        assert (error.expert_id, error.reason) == (7, "checksum")


async def test_a_schema_error_names_its_field_in_the_message(under, make_error):
    detail = [
        {"loc": ["gate", "temperature"], "msg": "Input should be greater than 0", "type": "x"},
        {"loc": ["top_k"], "msg": "Input should be a valid integer", "type": "y"},
    ]
    response = make_error(422, "invalid_input", "the request body does not match", detail)
    with pytest.raises(client.InvalidInput) as caught:
        await under(lambda request: response).call("predict", [[0, 0]])
    assert str(caught.value) == (
        "422 invalid_input: the request body does not match (gate.temperature: Input should "
        "be greater than 0; top_k: Input should be a valid integer)"
    )


async def test_a_5xx_names_the_request_id_the_server_logged_it_under(under, make_error):
    for status, code in ((503, "actor_failed"), (422, "invalid_input")):
        response = make_error(status, code, "told you", None, **{"X-Request-ID": "req-7"})
        with pytest.raises(client.HTTPStatusError) as caught:
            await under(lambda request, r=response: r, max_retries=0).call("predict", [[0, 0]])
        assert caught.value.request_id == "req-7"
        shown = f"{status} {code}: told you"
        assert str(caught.value) == (f"{shown} [request id req-7]" if status >= 500 else shown)


async def test_a_server_that_hangs_up_is_a_network_error(under):
    def hang_up(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    with pytest.raises(client.NetworkError):
        await under(hang_up, max_retries=0).call("predict", [[0, 0]])


async def test_a_timeout_without_text_says_what_ran_out(under):
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("")  # what httpx's async transports raise

    with pytest.raises(client.TimeoutError) as caught:
        await under(slow, timeout=1.5).call("predict", [[0, 0]])
    assert "no answer within the timeout (1.5 s)" in str(caught.value)


@pytest.mark.parametrize(
    "url", ["http://[::1", "http://127.0.0.1:99999", "ftp://host", "127.0.0.1:8000", "http://"]
)
def test_a_bad_base_url_is_a_protocol_error_at_construction(kind, url):
    with pytest.raises(client.ProtocolError) as caught:
        Client(url) if kind == "sync" else AsyncClient(url)
    assert url in str(caught.value)


async def test_non_json_error_bodies_still_map(under):
    response = httpx.Response(502, text="<html>bad gateway</html>")
    with pytest.raises(client.ServerError) as caught:
        await under(lambda request: response).call("model")
    assert caught.value.code == "http_502" and "bad gateway" in caught.value.message


async def test_answers_off_contract_raise_decoding_error(under):
    response = httpx.Response(200, json={"outputs": "nope"})
    with pytest.raises(client.DecodingError) as caught:
        await under(lambda request: response).call("predict", [[0, 0]])
    assert caught.value.detail


async def test_503_is_retried_with_growing_jittered_backoff(under, fake_server, make_error):
    fake_server.fail_next = [make_error(503, "not_ready"), make_error(503, "not_ready")]
    one = under(max_retries=3, backoff=0.2)
    prediction = await one.call("predict", [[0, 0]])
    assert prediction.outputs == [[0.0]]
    assert fake_server.calls["/v1/predict"] == 3
    assert len(one.sleeps) == 2
    for attempt, delay in enumerate(one.sleeps):
        step = 0.2 * 2**attempt
        assert step / 2 <= delay <= step


async def test_429_waits_retry_after_unless_it_exceeds_max_backoff(under, fake_server, make_error):
    fake_server.fail_next = [
        make_error(429, "pool_saturated", **{"Retry-After": "1.5"}),
        make_error(429, "pool_saturated", **{"Retry-After": "120"}),
    ]
    one = under(max_retries=3, max_backoff=5.0)
    with pytest.raises(client.RateLimited) as caught:
        await one.call("predict", [[0, 0]])
    # 1.5 s were waited out; 120 s exceed what this client waits, and a retry sooner would
    # go against the server's word: raised at once, not retried early.
    assert caught.value.retry_after == 120.0
    assert one.sleeps == [1.5] and fake_server.calls["/v1/predict"] == 2


async def test_an_expert_the_server_will_not_reread_in_time_is_not_retried(
    under, fake_server, make_error
):
    unavailable = {"expert_id": 3, "reason": "checksum mismatch"}
    fake_server.fail_next = [
        make_error(503, "expert_unavailable", "expert 3", unavailable, **{"Retry-After": "2"}),
        make_error(503, "expert_unavailable", "expert 3", unavailable, **{"Retry-After": "30"}),
    ]
    one = under(max_retries=3, max_backoff=10.0)
    with pytest.raises(client.ExpertUnavailable) as caught:
        await one.call("predict", [[0, 0]])
    # The first answer's 2 s fit in the client's patience and were waited out; the second
    # answer's 30 s did not, so it is raised at once, not after 3 pointless retries.
    assert caught.value.expert_id == 3 and caught.value.retry_after == 30.0
    assert one.sleeps == [2.0] and fake_server.calls["/v1/predict"] == 2


async def test_retries_are_bounded_then_the_last_error_is_raised(under, fake_server, make_error):
    fake_server.fail_next = [make_error(503, "not_ready")] * 5
    one = under(max_retries=2)
    with pytest.raises(client.ServiceUnavailable):
        await one.call("predict", [[0, 0]])
    assert fake_server.calls["/v1/predict"] == 3 and len(one.sleeps) == 2


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422, 500, 504])
async def test_other_statuses_are_never_retried(under, fake_server, make_error, status):
    fake_server.fail_next = [make_error(status, "x")]
    one = under(max_retries=5)
    with pytest.raises(client.HTTPStatusError):
        await one.call("predict", [[0, 0]])
    assert fake_server.calls["/v1/predict"] == 1 and one.sleeps == []


async def test_connect_errors_are_retried_read_timeouts_are_not(under, fake_server):
    fake_server.fail_next = [httpx.ConnectError("refused"), httpx.ConnectTimeout("slow")]
    one = under(max_retries=2)
    assert (await one.call("predict", [[0, 0]])).outputs == [[0.0]]
    assert len(one.sleeps) == 2
    fake_server.fail_next = [httpx.ReadTimeout("slow")]
    with pytest.raises(client.TimeoutError):
        await one.call("predict", [[0, 0]])
    assert len(one.sleeps) == 2


def _httpx_exception_classes() -> list[type[Exception]]:
    names = [n for n in httpx.__all__ if isinstance(getattr(httpx, n), type)]
    return [getattr(httpx, n) for n in names if issubclass(getattr(httpx, n), Exception)]


def _instantiate(cls: type[Exception], request: httpx.Request) -> Exception:
    if issubclass(cls, httpx.HTTPStatusError):
        return cls("boom", request=request, response=httpx.Response(500, request=request))
    for args in (("boom",), ()):
        try:
            return cls(*args)
        except TypeError:
            continue
    raise AssertionError(f"cannot build {cls}")


@pytest.mark.parametrize("exc_class", _httpx_exception_classes(), ids=lambda c: c.__name__)
async def test_no_httpx_exception_escapes(under, exc_class):
    def handler(request: httpx.Request) -> httpx.Response:
        raise _instantiate(exc_class, request)

    one = under(handler, max_retries=1)
    for method, args in (("predict", ([[0, 0]],)), ("model", ()), ("metrics", ())):
        with pytest.raises(client.MomlpError) as caught:
            await one.call(method, *args)
        assert not isinstance(caught.value, httpx.HTTPError)
        assert isinstance(caught.value.__cause__, exc_class)


async def test_probes_answer_false_when_unreachable_or_unready(under, make_error):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    one = under(refuse)
    assert await one.call("health") is False
    assert await one.call("ready") is False
    not_ready = under(lambda request: make_error(503, "not_ready"), max_retries=3)
    assert await not_ready.call("ready") is False
    assert not_ready.sleeps == []


@pytest.mark.parametrize(
    ("inputs", "kwargs"),
    [
        ([0.1, 0.2], {}),
        ([[0.1, 0.2], [0.3]], {}),
        ([[0.1, float("nan")]], {}),
        ([["a", "b"]], {}),
        ([[True, False]], {}),
        ([], {}),
        (np.zeros((2, 2, 2)), {}),
        (np.array([[np.inf, 0.0]]), {}),
        (np.array([["a", "b"]]), {}),
        ([[0.1, 0.2]], {"top_k": 0}),
        ([[0.1, 0.2]], {"mode": "fast"}),
        ([[10**400, 0.2]], {}),
    ],
    ids=[
        "1-D",
        "ragged",
        "nan",
        "strings",
        "bools",
        "empty",
        "3-D",
        "np-inf",
        "np-strings",
        "top_k-0",
        "bad-mode",
        "beyond-float",
    ],
)
async def test_bad_inputs_are_refused_before_sending(under, fake_server, inputs, kwargs):
    with pytest.raises(client.InputError):
        await under().call("predict", inputs, **kwargs)
    assert fake_server.calls["/v1/predict"] == 0


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_real_transport_connection_refused_is_a_connect_error(kind):
    url = f"http://127.0.0.1:{_closed_port()}"
    sleeps: list[float] = []
    if kind == "sync":
        with Client(url, max_retries=1, sleep=sleeps.append, timeout=5) as sync_client:
            with pytest.raises(client.ConnectError):
                sync_client.predict([[0.0, 0.0]])
            assert sync_client.health() is False
    else:

        async def sleep(seconds: float) -> None:
            sleeps.append(seconds)

        async with AsyncClient(url, max_retries=1, sleep=sleep, timeout=5) as async_client:
            with pytest.raises(client.ConnectError):
                await async_client.predict([[0.0, 0.0]])
            assert await async_client.health() is False
    assert len(sleeps) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gate": {"beam": [1.5]}, "binary": True},
        {"gate": {"beam": [1.5]}},
        {"gate": {"beam": True}},
        {"gate": {"beam": [0]}},
        {"gate": {"temperature": "0.5"}, "binary": True},
        {"gate": {"temperature": float("nan")}},
        {"gate": {"top_p": float("inf")}, "binary": True},
        {"gate": {"score": 2}},
        {"conditions": {"condition": float("nan")}},
        {"conditions": {"condition": [0.1, float("nan")]}},
        {"conditions": {"condition": 1.0}},
        {"conditions": {"conditions": [[0.1, 0.2], [0.3]]}},
        {"conditions": {"conditions": np.array([[np.inf, 0.0]])}},
        {"conditions": {"condition_ids": [1, 2]}},
        {"conditions": {"condition_ids": []}},
    ],
    ids=[
        "beam-1.5-npy", "beam-1.5-json", "beam-bool", "beam-0", "temperature-str-npy",
        "temperature-nan", "top_p-inf-npy", "score-int", "condition-nan-scalar",
        "condition-nan", "condition-scalar", "conditions-ragged", "conditions-np-inf",
        "condition_ids-ints", "condition_ids-empty",
    ],
)
async def test_bad_gates_and_conditions_are_refused_before_sending(under, fake_server, kwargs):
    # Each was sent (a beam of 1.5 in a query string served as 1; a NaN condition refused by
    # the server under another name) or raised a bare TypeError.
    one = under()
    with pytest.raises(client.InputError) as caught:
        await one.call("predict", [[0.1, 0.2]], **kwargs)
    assert caught.value.fields.get("field") in {*kwargs.get("gate", {}), *kwargs.get(
        "conditions", {})}
    if "binary" not in kwargs:
        with pytest.raises(client.InputError):
            await one.call("route", [[0.1, 0.2]], **kwargs)
    assert fake_server.calls["/v1/predict"] == fake_server.calls["/v1/route"] == 0


def _bodies_sent(fake_server: Any, sent: list[dict[str, Any]]) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return fake_server.handler(request)

    return handler


async def test_one_beam_width_is_sent_as_that_width_for_every_level(under, fake_server):
    sent: list[dict[str, Any]] = []
    await under(_bodies_sent(fake_server, sent)).call(
        "predict", [[0.1, 0.2]], gate={"beam": np.int64(2)}
    )
    assert sent[0]["gate"] == {"beam": [2]}


async def test_one_condition_name_is_every_rows_not_one_letter_a_row(under, fake_server):
    # "north" went as ["n", "o", "r", "t", "h"]: on a 5-row batch, a letter per row.
    sent: list[dict[str, Any]] = []
    one = under(_bodies_sent(fake_server, sent))
    await one.call("predict", [[0.1, 0.2]] * 5, conditions={"condition_ids": "north"})
    assert sent[-1]["condition_ids"] == ["north"]
    await one.call("route", [[0.1, 0.2]], conditions={"condition_ids": np.array(["north"])})
    assert sent[-1]["condition_ids"] == ["north"]


async def test_a_closed_client_says_so_in_the_packages_tree(under, fake_server):
    one = under()
    await one.close()
    for method, args in (("predict", ([[0, 0]],)), ("health", ()), ("model", ())):
        with pytest.raises(client.ClientClosed) as caught:
            await one.call(method, *args)
        # Also a RuntimeError, as httpx's own was, so callers written against it still work;
        # health() raises it too: a closed client is the caller's mistake, not a down server.
        assert isinstance(caught.value, RuntimeError) and "closed" in str(caught.value)
    assert fake_server.calls["/v1/predict"] == 0


@pytest.mark.parametrize("setting", [{"backoff": -0.1}, {"backoff": float("nan")},
                                     {"max_backoff": -1.0}])
def test_a_negative_backoff_is_refused_when_the_client_is_made(kind, setting):
    # It used to fail at the first retry, as a bare ValueError from sleep().
    with pytest.raises(ValueError, match="backoff"):
        Client(**setting) if kind == "sync" else AsyncClient(**setting)
