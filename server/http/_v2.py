"""Open Inference Protocol v2 (KServe / Triton REST) beside `/v1`.

Same auth, body limits, batching and errors as `/v1` (errors in the protocol's
`{"error": "..."}` shape, see `_errors`). The model is the store being served, named by
`Settings.model_name` (default: the store directory's name); its version is the store version.
Request `parameters` set the gate as `/v1`'s `gate` object does (`top_k`, `mode`,
`temperature`, `min_weight`, `top_p`, `beam` as "2,2", `score`; the same server-side caps); the
response carries the expert ids (-1 past a row's last kept expert) and gate
weights as extra output tensors, and the per-request VRAM and store version as parameters.
No Content-Type is required: tritonclient's sync client may send none. A body may come
compressed (Content-Encoding gzip or deflate, tritonclient's `request_compression_algorithm`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from server._exceptions import HttpError
from server._settings import Settings
from server.http._body import parse_encoded, read_body_limited
from server.http._deadline import Deadlines
from server.http._hot import HotRoute
from server.http._openapi import inline_defs
from server.http._predict import submit_in_time
from server.http._v2_codec import (
    HEADER_LENGTH,
    InferRequest,
    OutputTensor,
    encode_response,
    parse_infer,
    wanted_outputs,
)
from server.http._v2_models import (
    LiveResponse,
    ModelMetadata,
    ReadyResponse,
    ServerMetadata,
    TensorMetadata,
    V2Error,
)
from server.kinds import GateRequest, check_attached_conditions
from server.serving import ServingState, StoreVersion

__all__ = ["INPUT_NAME", "add_v2_routes", "hot_v2_routes", "infer", "model_name"]

INPUT_NAME = "input"
_OUTPUT_NAMES = ("output", "experts", "weights")
_INFER_PATH = "/v2/models/{name}/infer"
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": V2Error, "description": text}
    for status, text in (
        (400, "the request or its tensors are not valid for this model"),
        (401, "missing or wrong bearer key"),
        (404, "no such model or version"),
        (413, "too many rows or bytes"),
        (429, "queue full; see Retry-After"),
        (503, "not ready, or an expert cannot be loaded"),
        (504, "no answer in time"),
    )
}
_INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": inline_defs(InferRequest.model_json_schema())},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "binary tensor data: the JSON header, then the tensors' bytes",
            },
        },
    }
}


def model_name(settings: Settings) -> str:
    return settings.model_name or settings.store.resolve().name or "momlp"


def _serving(request: Request) -> ServingState:
    state: ServingState = request.app.state.serving
    return state


def _version_for(serving: ServingState, name: str, version: str | None) -> StoreVersion:
    current = serving.current()
    if name != model_name(serving.settings):
        asked = "" if version is None else f" (version {version!r})"
        raise HttpError(404, "not_found", f"unknown model {name!r}{asked}")
    if version not in (None, "", current.version):
        # A client pinned to a version a hot swap replaced: the model is there, not that.
        raise HttpError(
            404,
            "not_found",
            f"model {name!r} has no version {version!r}: it serves version "
            f"{current.version!r}",
        )
    return current


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}
_GATE_PARAMETERS = {
    "top_k": int,
    "mode": str,
    "temperature": float,
    "min_weight": float,
    "top_p": float,
    "score": str,
}


# The ranges `/v1` states in its models (server/http/_models.py), for the numbers here.
_GATE_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "top_k": (lambda v: v >= 1, ">= 1"),
    "temperature": (lambda v: v > 0, "> 0"),
    "min_weight": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
}


def _gate(parameters: dict[str, Any]) -> GateRequest:
    """The request `parameters` that set the gate (the same knobs as `/v1`'s `gate`)."""
    values: dict[str, Any] = {}
    for name, kind in _GATE_PARAMETERS.items():
        value = parameters.get(name)
        if value is not None:
            values[name] = _parameter(name, value, kind)
            in_range = _GATE_RANGES.get(name)
            if in_range is not None and not in_range[0](values[name]):
                raise HttpError(
                    422, "invalid_input", f"parameter {name} must be {in_range[1]}"
                )
    beam = parameters.get("beam")
    if beam is not None:
        try:
            values["beam"] = tuple(int(w) for w in str(beam).split(","))
        except ValueError:
            raise HttpError(
                422, "invalid_input", "parameter beam must be widths like '2,2'"
            ) from None
    return GateRequest(**values)


def _parameter(name: str, value: Any, kind: type) -> Any:
    """One gate parameter as `kind`: a number may come as a JSON number or a string (clients
    differ), an integer as 3, 3.0 or "3"; NaN and infinities are refused (422)."""
    message = f"parameter {name} must be {_KIND_NAMES[kind]}"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise HttpError(422, "invalid_input", message)
    if kind is str:
        return str(value)
    try:
        number = value if isinstance(value, int) else float(value)
        if kind is float:
            number = float(number)
    except (ValueError, OverflowError):
        raise HttpError(422, "invalid_input", message) from None
    if isinstance(number, float):
        if not math.isfinite(number):
            raise HttpError(422, "invalid_input", f"parameter {name} must be a finite number")
        if kind is int:
            if not number.is_integer():
                raise HttpError(422, "invalid_input", message)
            number = int(number)
    return number


def _metadata(current: StoreVersion, name: str) -> ModelMetadata:
    m = current.manifest
    return ModelMetadata(
        name=name,
        versions=[current.version],
        platform="momlp",
        # The rows the kind routes on: x, or [x, I] for a hyper store (x then its condition).
        inputs=[TensorMetadata(name=INPUT_NAME, datatype="FP32",
                               shape=[-1, current.model.input_dim])],
        outputs=[
            TensorMetadata(name="output", datatype="FP32", shape=[-1, m.output_dim]),
            TensorMetadata(name="experts", datatype="INT64", shape=[-1, -1]),
            TensorMetadata(name="weights", datatype="FP32", shape=[-1, -1]),
        ],
    )


async def infer(request: Request, name: str, version: str | None) -> Response:
    """POST /v2/models/{name}[/versions/{version}]/infer (also called by `HotRoutes`)."""
    serving = _serving(request)
    settings = serving.settings
    async with serving.use() as current:
        _version_for(serving, name, version)
        deadlines: Deadlines = request.app.state.deadlines
        body = await read_body_limited(request, settings.max_body_bytes, deadlines.body)
        parse = functools.partial(
            parse_infer,
            header_length=request.headers.get(HEADER_LENGTH),
            input_name=INPUT_NAME,
            input_dim=current.model.input_dim,
            max_rows=settings.max_rows,
        )
        parsed = await parse_encoded(
            body, request.headers.get("content-encoding"), parse,
            max_bytes=settings.max_body_bytes,
        )
        wanted_outputs(parsed.request, list(_OUTPUT_NAMES))  # 422 before any work
        options = current.model.resolve(_gate(parsed.request.parameters), settings)
        x = check_attached_conditions(current.model, parsed.x, settings)
        answer = await submit_in_time(current, x, options, deadlines.answer, request.scope)
    request.app.state.metrics.observe_prediction(
        parsed.x.shape[0], [(s.cache, s.load_ms) for s in answer.stats]
    )
    outputs = [
        OutputTensor("output", "FP32", answer.outputs.astype(np.float32)),
        OutputTensor("experts", "INT64", answer.experts.astype(np.int64)),
        # Rows may keep fewer experts than others (min_weight, top_p): padded with -1 / 0.
        OutputTensor("weights", "FP32", answer.weights.astype(np.float32)),
    ]
    content, header_length = encode_response(
        parsed.request,
        outputs,
        model_name=name,
        model_version=current.version,
        parameters={"vram_bytes": answer.vram_bytes, "store_version": current.version},
    )
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(
        content,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(header_length)},
    )


def hot_v2_routes(settings: Settings) -> dict[tuple[str, str], HotRoute]:
    """The served model's unversioned infer path, for `HotRoutes` (other paths: FastAPI)."""
    name = model_name(settings)

    async def infer_served(request: Request) -> Response:
        return await infer(request, name, None)

    return {("POST", f"/v2/models/{name}/infer"): HotRoute(infer_served, _INFER_PATH)}


def add_v2_routes(app: FastAPI) -> None:
    @app.get("/v2/health/live", response_model=LiveResponse, tags=["v2"])
    async def live() -> LiveResponse:
        return LiveResponse(live=True)

    @app.get(
        "/v2/health/ready", response_model=ReadyResponse, responses=_ERRORS, tags=["v2"]
    )
    async def ready(request: Request) -> ReadyResponse:
        _serving(request).check_ready()  # NotReady (503), as /readyz
        return ReadyResponse(ready=True)

    @app.get("/v2", response_model=ServerMetadata, tags=["v2"])
    async def server_metadata() -> ServerMetadata:
        return ServerMetadata(
            name="momlp",
            version=importlib.metadata.version("momlp"),
            extensions=["binary_tensor_data"],
        )

    async def model_metadata(request: Request, name: str, version: str | None) -> ModelMetadata:
        return _metadata(_version_for(_serving(request), name, version), name)

    async def model_ready(request: Request, name: str, version: str | None) -> ReadyResponse:
        _version_for(_serving(request), name, version)
        return ReadyResponse(ready=True)

    model_paths = (("/v2/models/{name}", ""), ("/v2/models/{name}/versions/{version}", "v"))
    for path, version_part in model_paths:
        app.add_api_route(
            path, _bind(model_metadata, version_part), methods=["GET"],
            response_model=ModelMetadata, responses=_ERRORS, tags=["v2"],
        )
        app.add_api_route(
            f"{path}/ready", _bind(model_ready, version_part), methods=["GET"],
            response_model=ReadyResponse, responses=_ERRORS, tags=["v2"],
        )
        app.add_api_route(
            f"{path}/infer", _bind(infer, version_part), methods=["POST"], tags=["v2"],
            responses=_ERRORS, openapi_extra=_INFER_BODY,
            summary="Open Inference Protocol infer (JSON or binary tensor data)",
        )


def _bind(handler: Any, version_part: str) -> Any:
    """The endpoint for a path with (`version_part` set) or without a version segment."""
    if version_part:

        async def with_version(request: Request, name: str, version: str) -> Any:
            return await handler(request, name, version)

        return with_version

    async def without_version(request: Request, name: str) -> Any:
        return await handler(request, name, None)

    return without_version
