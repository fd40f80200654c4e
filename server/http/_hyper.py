"""`POST /v1/generate`: θ_I of a hyper store as an ordinary expert file.

The body names one condition (`condition`: its values, or `condition_id`: a name in the
store's table). The answer is the safetensors file of θ_I = f(I) in exactly the store's
expert format (a PReLU MLP with γ = 0, which is ReLU; zero biases where g has none), so a
plain momlp store can take it (`StoreWriter.link_expert_file`). It is generated in the HTTP
process with the same f and the same one-condition forward the actors use.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, ValidationError
from starlette.concurrency import run_in_threadpool

from server._exceptions import HttpError, InvalidRequest
from server.http._body import (
    parse_encoded,
    read_body_limited,
    require_json,
    validation_detail,
)
from server.http._deadline import Deadlines
from server.http._metrics import Metrics
from server.http._models import ConditionId, FiniteNumber, _Strict
from server.http._responses import ERROR_RESPONSES
from server.kinds import expert_generator
from server.serving import ServingState

__all__ = ["GenerateRequest", "add_hyper_routes"]

KEY_HEADER = "X-Momlp-Key"
VERSION_HEADER = "X-Momlp-Store-Version"


class GenerateRequest(_Strict):
    """One condition: its values, or its name in the store's table."""

    condition: list[FiniteNumber] | None = Field(default=None, min_length=1)
    condition_id: ConditionId | None = None


def add_hyper_routes(app: FastAPI) -> None:
    @app.post(
        "/v1/generate",
        response_class=Response,
        responses={
            **ERROR_RESPONSES,
            200: {"content": {"application/octet-stream": {}},
                  "description": "θ_I as a safetensors expert file"},
        },
        summary="Generate θ_I for one condition (kind hyper) as a store expert file",
    )
    async def generate(request: Request) -> Response:
        serving: ServingState = request.app.state.serving
        metrics: Metrics = request.app.state.metrics
        settings = serving.settings
        deadlines: Deadlines = request.app.state.deadlines
        require_json(request)
        body = await read_body_limited(request, settings.max_body_bytes, deadlines.body)

        def parse(decoded: bytes) -> GenerateRequest:
            try:
                return GenerateRequest.model_validate_json(decoded)
            except ValidationError as exc:
                raise HttpError(422, "invalid_input",
                                "the request body does not match the schema",
                                detail=validation_detail(exc)) from exc

        # Off the loop when compressed (on any store kind: the kind is checked after it).
        parsed = await parse_encoded(
            body, request.headers.get("content-encoding"), parse,
            max_bytes=settings.max_body_bytes,
        )
        if (parsed.condition is None) == (parsed.condition_id is None):
            raise InvalidRequest("give exactly one of condition and condition_id",
                                 field="condition")
        async with serving.use() as version:
            kind = version.model.kind
            model = expert_generator(version.model)
            if model is None:
                raise HttpError(404, "not_found", f"a store of kind {kind!r} generates no weights",
                                detail={"kind": kind})
            if parsed.condition_id is not None:
                condition = model.condition_of(parsed.condition_id)
            else:
                condition = model.check_condition(parsed.condition)
            key, data = await run_in_threadpool(model.generate_file, condition)
            store_version = version.version
        metrics.observe_generations(1, where="generate")
        return Response(
            data,
            media_type="application/octet-stream",
            headers={KEY_HEADER: key, VERSION_HEADER: store_version},
        )
