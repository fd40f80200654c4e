"""The synchronous client: `BaseClient` decisions, blocking I/O."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import httpx

from ._base import DEFAULT_BASE_URL, BaseClient, Mode, RequestSpec, TimeoutTypes
from ._exceptions import MomlpError
from ._models import (
    ExpertsInfo,
    GeneratedExpert,
    GraphInfo,
    ModelInfo,
    Prediction,
    Routing,
)

__all__ = ["Client"]


class Client(BaseClient):
    """Blocking client of a momlp server.

    >>> with Client("http://127.0.0.1:8000") as momlp:
    ...     prediction = momlp.predict([[0.1, 0.2]], return_stats=True)

    Connect errors, 429 and 503 are retried up to `max_retries` times, after the answer's
    Retry-After or else exponential back-off with jitter (at most `max_backoff`); a 429 or 503
    whose Retry-After exceeds `max_backoff` is raised at once (a retry sooner would go against
    the server's word). `sleep` is injectable so tests never wait.

    One client may be shared by threads (httpx's pool is thread-safe, and nothing here keeps
    per-call state); a client is closed once, by `close()` or its `with` block.
    """

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
        transport: httpx.BaseTransport | None = None,
        limits: httpx.Limits | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(
            base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            backoff=backoff,
            max_backoff=max_backoff,
            binary_min_values=binary_min_values,
            rng=rng,
        )
        self._sleep = sleep
        kwargs: dict[str, Any] = {"limits": limits} if limits is not None else {}
        self._http = httpx.Client(
            base_url=base_url,
            headers=self._headers,
            timeout=timeout,
            transport=transport,
            **kwargs,
        )

    def predict(
        self,
        inputs: Any,
        top_k: int = 1,
        mode: Mode | None = None,
        return_stats: bool = False,
        binary: bool | None = None,
        gate: Mapping[str, Any] | None = None,
        conditions: Mapping[str, Any] | None = None,
        return_routing: bool = False,
    ) -> Prediction:
        """Outputs for a 2-D batch `inputs` [rows, input_dim] (lists, tuples, numpy arrays...).

        `return_routing` (pmoe stores): `Prediction.patches` says which patches each expert
        took for each row, with their gates.
        """
        spec = self._build_predict(
            inputs, top_k=top_k, mode=mode, return_stats=return_stats, binary=binary,
            gate=gate, conditions=conditions, return_routing=return_routing,
        )
        return self._decode_prediction(self._request(spec))

    def route(
        self, inputs: Any, top_k: int = 1, mode: Mode | None = None,
        gate: Mapping[str, Any] | None = None, conditions: Mapping[str, Any] | None = None,
    ) -> Routing:
        """Which experts each row goes to, with weights and distances; loads nothing.

        `gate` (predict too): temperature, min_weight, top_p, beam, score (server caps apply).
        `conditions` (predict too; hyper stores): {"conditions": rows}, {"condition": values}
        or {"condition_ids": names} (one name: every row's).
        """
        spec = self._build_route(inputs, top_k=top_k, mode=mode, gate=gate, conditions=conditions)
        return self._decode_routing(self._request(spec))

    def model(self, include_prototypes: bool = False) -> ModelInfo:
        return self._decode_model(self._request(self._build_model(include_prototypes)))

    def experts(self) -> ExpertsInfo:
        return self._decode_experts(self._request(self._build_get("/v1/experts")))

    def graph(self) -> GraphInfo:
        """A graph store's nodes, edges and waves; `NotFound` for the other kinds."""
        return self._decode_graph(self._request(self._build_get("/v1/graph")))

    def generate(
        self, condition: Any = None, *, condition_id: str | None = None
    ) -> GeneratedExpert:
        """θ for one condition (its values, or `condition_id`: a name of the store's table) as
        a store expert file; hyper stores only (`NotFound` for the other kinds)."""
        spec = self._build_generate(condition, condition_id)
        return self._decode_generated(self._request(spec))

    def health(self) -> bool:
        """True when the server answers /healthz; False when it cannot be reached or fails."""
        try:
            self._request(self._build_get("/healthz", retry=False))
        except MomlpError as exc:
            return self._probe_answer(exc)
        return True

    def ready(self) -> bool:
        """True when /readyz says the store is loaded and the pool is up."""
        try:
            self._request(self._build_get("/readyz", retry=False))
        except MomlpError as exc:
            return self._probe_answer(exc)
        return True

    def metrics(self) -> str:
        """The Prometheus text of /metrics."""
        response = self._request(self._build_get("/metrics"))
        return response.text

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _request(self, spec: RequestSpec) -> httpx.Response:
        attempt = 0
        while True:
            if self._http.is_closed:  # also when closed by another thread during a back-off
                raise self._closed_error(spec)
            try:
                with self._translate(spec):
                    response = self._http.request(
                        spec.method, spec.path, **self._httpx_kwargs(spec)
                    )
                return self._check_status(response)
            except MomlpError as exc:
                delay = self._retry_delay(spec, attempt, exc)
                if delay is None:
                    raise
            self._sleep(delay)
            attempt += 1
