"""What the sync and async clients share: building requests, decoding answers, retry policy.

The two subclasses only do I/O (send, sleep); every decision is made here so that they behave
the same by construction. What an error answer or an httpx exception becomes is `_translate`'s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import httpx
import pydantic
import pydantic_core

from ._encoding import NPY_CONTENT_TYPE, encode_inputs
from ._exceptions import (
    ClientClosed,
    ConnectError,
    DecodingError,
    HTTPStatusError,
    MomlpError,
    ProtocolError,
    RateLimited,
    ServerError,
    ServiceUnavailable,
    TransportError,
)
from ._models import ExpertsInfo, GeneratedExpert, GraphInfo, ModelInfo, Prediction, Routing
from ._options import (
    check_conditions,
    check_gate,
    check_generate,
    check_options,
    gate_query,
)
from ._translate import TimeoutTypes, has_request, status_error, transport_error

__all__ = ["DEFAULT_BASE_URL", "BaseClient", "Mode", "RequestSpec", "TimeoutTypes"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
USER_AGENT = "momlp-client/0.1"
GENERATED_KEY_HEADER = "X-Momlp-Key"
GENERATED_VERSION_HEADER = "X-Momlp-Store-Version"

Mode = Literal["tree", "exact"]
M = TypeVar("M", bound=pydantic.BaseModel)


@dataclass(frozen=True)
class RequestSpec:
    """One HTTP request, independent of the client flavour that sends it."""

    method: str
    path: str
    params: dict[str, str] = field(default_factory=dict)
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    retry: bool = True


class BaseClient:
    """Configuration, request building, answer decoding and the retry policy."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout: TimeoutTypes = 30.0,
        max_retries: int = 3,
        backoff: float = 0.1,
        max_backoff: float = 10.0,
        binary_min_values: int = 16384,
        rng: random.Random | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        # Checked now: a negative wait would only fail at the first retry, as a bare
        # ValueError from sleep() in the middle of a call.
        if not (backoff >= 0 and math.isfinite(backoff)):
            raise ValueError(f"backoff must be a finite number >= 0, got {backoff!r}")
        if not max_backoff >= 0:
            raise ValueError(f"max_backoff must be >= 0, got {max_backoff!r}")
        _check_base_url(base_url)
        self.base_url = base_url
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.binary_min_values = binary_min_values
        self._timeout = timeout
        self._rng = rng or random.Random()
        # As bytes: a key beyond ASCII goes as its UTF-8, which httpx's str headers refuse.
        self._headers: dict[bytes, bytes] = {
            b"User-Agent": USER_AGENT.encode(),
            b"Accept": b"application/json",
        }
        key = _bearer_key(api_key)
        if key is not None:
            self._headers[b"Authorization"] = b"Bearer " + key

    def _build_predict(
        self,
        inputs: Any,
        *,
        top_k: int,
        mode: Mode | None,
        return_stats: bool,
        binary: bool | None,
        gate: Mapping[str, Any] | None = None,
        conditions: Mapping[str, Any] | None = None,
        return_routing: bool = False,
    ) -> RequestSpec:
        check_options(top_k, mode)
        gate = check_gate(gate)
        conditions = check_conditions(conditions)
        if conditions:
            binary = False  # conditions travel in the JSON body only
        encoded = encode_inputs(inputs, binary=binary, binary_min_values=self.binary_min_values)
        if encoded.npy is not None:
            params = {"top_k": str(top_k), "return_stats": "true" if return_stats else "false"}
            if mode is not None:
                params["mode"] = mode
            if return_routing:
                params["return_routing"] = "true"
            params.update(gate_query(gate))
            return RequestSpec(
                "POST",
                "/v1/predict",
                params=params,
                content=encoded.npy,
                headers={"Content-Type": NPY_CONTENT_TYPE},
            )
        body: dict[str, Any] = {"inputs": encoded.rows, "top_k": top_k, "mode": mode}
        body["return_stats"] = return_stats
        if return_routing:
            body["return_routing"] = True
        if gate:
            body["gate"] = gate
        if conditions:
            body.update(conditions)
        return RequestSpec("POST", "/v1/predict", json=body)

    def _build_route(
        self,
        inputs: Any,
        *,
        top_k: int,
        mode: Mode | None,
        gate: Mapping[str, Any] | None = None,
        conditions: Mapping[str, Any] | None = None,
    ) -> RequestSpec:
        check_options(top_k, mode)
        gate = check_gate(gate)
        conditions = check_conditions(conditions)
        encoded = encode_inputs(inputs, binary=False)
        body: dict[str, Any] = {"inputs": encoded.rows, "top_k": top_k, "mode": mode}
        if gate:
            body["gate"] = gate
        if conditions:
            body.update(conditions)
        return RequestSpec("POST", "/v1/route", json=body)

    @staticmethod
    def _build_model(include_prototypes: bool) -> RequestSpec:
        params = {"include_prototypes": "true"} if include_prototypes else {}
        return RequestSpec("GET", "/v1/model", params=params)

    @staticmethod
    def _build_generate(condition: Any, condition_id: str | None) -> RequestSpec:
        return RequestSpec(
            "POST",
            "/v1/generate",
            json=check_generate(condition, condition_id),
            headers={"Accept": "application/octet-stream"},
        )

    @staticmethod
    def _build_get(path: str, *, retry: bool = True) -> RequestSpec:
        return RequestSpec("GET", path, retry=retry)

    def _httpx_kwargs(self, spec: RequestSpec) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"params": spec.params or None, "headers": spec.headers or None}
        if spec.content is not None:
            kwargs["content"] = spec.content
        elif spec.json is not None:
            # pydantic-core's serializer is ~5x faster than json.dumps on big float lists; the
            # inputs were checked finite before, so no NaN can reach it.
            kwargs["content"] = pydantic_core.to_json(spec.json)
            kwargs["headers"] = {"Content-Type": "application/json", **spec.headers}
        return kwargs

    @contextmanager
    def _translate(self, spec: RequestSpec) -> Iterator[None]:
        """Turn every httpx exception raised inside into this package's tree."""
        try:
            yield
        except httpx.HTTPStatusError as exc:
            raise status_error(exc.response) from exc
        except (httpx.HTTPError, httpx.InvalidURL, httpx.CookieConflict, httpx.StreamError) as exc:
            raise transport_error(exc, f"{spec.method} {spec.path}", self._timeout) from exc

    @staticmethod
    def _closed_error(spec: RequestSpec) -> ClientClosed:
        # httpx would raise a bare RuntimeError, outside this package's tree.
        return ClientClosed(
            f"{spec.method} {spec.path}: this client is closed; make a new one",
            url=f"{spec.method} {spec.path}",
        )

    def _check_status(self, response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        raise status_error(response)

    def _retry_delay(self, spec: RequestSpec, attempt: int, error: MomlpError) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up and raise `error`."""
        if not spec.retry or attempt >= self.max_retries:
            return None
        retryable = isinstance(error, ConnectError | RateLimited | ServiceUnavailable)
        if not retryable:
            return None
        if isinstance(error, HTTPStatusError) and (error.retry_after or 0.0) > self.max_backoff:
            # The server asks for a longer wait than this client allows (for a 503 naming an
            # expert: it will not read that file again before then): a retry sooner would be
            # against its word, and gets the same answer.
            return None
        if isinstance(error, HTTPStatusError) and error.retry_after is not None:
            return min(max(error.retry_after, 0.0), self.max_backoff)
        # Exponential back-off with "equal jitter": at least half the step, so retries of many
        # clients spread out but none hammers the server immediately.
        step = min(self.backoff * 2.0**attempt, self.max_backoff)
        return step / 2 + self._rng.random() * step / 2

    @staticmethod
    def _decode(response: httpx.Response, model: type[M]) -> M:
        try:
            return model.model_validate_json(response.content)
        except pydantic.ValidationError as exc:
            raise DecodingError(
                f"{model.__name__} answer does not match the v1 contract: {exc.error_count()} "
                "problem(s)",
                url=str(response.request.url) if has_request(response) else "",
                detail=exc.errors(include_url=False, include_context=False),
            ) from exc

    def _decode_prediction(self, response: httpx.Response) -> Prediction:
        return self._decode(response, Prediction)

    def _decode_routing(self, response: httpx.Response) -> Routing:
        return self._decode(response, Routing)

    def _decode_model(self, response: httpx.Response) -> ModelInfo:
        return self._decode(response, ModelInfo)

    def _decode_experts(self, response: httpx.Response) -> ExpertsInfo:
        return self._decode(response, ExpertsInfo)

    def _decode_graph(self, response: httpx.Response) -> GraphInfo:
        return self._decode(response, GraphInfo)

    @staticmethod
    def _decode_generated(response: httpx.Response) -> GeneratedExpert:
        key = response.headers.get(GENERATED_KEY_HEADER)
        version = response.headers.get(GENERATED_VERSION_HEADER)
        if key is None or version is None or not response.content:
            raise DecodingError(
                f"a /v1/generate answer needs a body and the {GENERATED_KEY_HEADER} and "
                f"{GENERATED_VERSION_HEADER} headers",
                url=str(response.request.url) if has_request(response) else "",
            )
        return GeneratedExpert(data=response.content, key=key, store_version=version)

    @staticmethod
    def _probe_answer(error: MomlpError) -> bool:
        """health()/ready(): no answer or a 5xx means "no"; a 4xx (bad key?) is raised."""
        if isinstance(error, TransportError | ServerError):
            return False
        raise error


def _bearer_key(api_key: str | None) -> bytes | None:
    """The key as the server compares it: UTF-8 bytes, without surrounding whitespace (a key
    read from a file ends in a newline; httpx refused a key beyond ASCII with a bare
    UnicodeEncodeError). A blank key is no key, as on the server."""
    key = (api_key or "").strip()
    if any(ord(char) < 32 or ord(char) == 127 for char in key):
        raise ValueError("api_key holds a control character, which no HTTP header can carry")
    return key.encode("utf-8") or None


def _check_base_url(base_url: str) -> None:
    """A ProtocolError (the tree's "bad URL") now, not an httpx error on the first call."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ProtocolError(f"{base_url!r} is not a URL: {exc}", url=base_url) from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ProtocolError(
            f"{base_url!r} is not an http:// or https:// URL with a host", url=base_url
        )
    if url.port is not None and not 0 < url.port < 65536:
        raise ProtocolError(f"{base_url!r}: port {url.port} is not 1-65535", url=base_url)
