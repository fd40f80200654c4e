"""What the v1 routes share: the error answers their schema documents, and a model as a body."""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel

from server.http._models import ErrorResponse

__all__ = ["ERROR_RESPONSES", "model_response"]

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (401, "missing or wrong bearer key"),
        (413, "too many rows or bytes"),
        (415, "unsupported Content-Type"),
        (422, "bad shape, dimension, number or option"),
        (429, "queue full; see Retry-After"),
        (503, "an expert cannot be loaded, or not ready"),
        (504, "no answer in time"),
    )
}


def model_response(model: BaseModel) -> Response:
    """`model` as the JSON body (pydantic's encoder: the documented shape, no second dict)."""
    return Response(model.model_dump_json(), media_type="application/json")
