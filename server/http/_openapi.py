"""The OpenAPI schema states what the server enforces, so a request the schema allows is one
the server accepts: rows of exactly the store's input dimension, at most `max_rows` of them,
values within the router's range, `top_k` at most the number of experts, and under /v2 the
one model name and version served.

What it cannot state: that a binary body (npy, raw float32, the v2 binary extension) holds a
well-formed array, and that a v2 tensor's `data` holds as many values as its `shape` says.

The dimension and the number of experts belong to the store version being served, so the
schema is rebuilt from FastAPI's base whenever the version changes.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.serving import ServingState

__all__ = ["MAX_ABS_INPUT", "install_openapi"]

# The router refuses |x| above this: squared distances would overflow float32.
MAX_ABS_INPUT = 1e15
_BODY_PATHS = ("/v1/predict", "/v1/route")


def _tighten_body(schema: dict[str, Any], input_dim: int, max_rows: int, num_experts: int) -> None:
    props = schema.get("properties", {})
    inputs = props.get("inputs")
    if inputs is not None:
        inputs["maxItems"] = max_rows
        row = inputs["items"]
        row["minItems"] = row["maxItems"] = input_dim
        row["items"].update(minimum=-MAX_ABS_INPUT, maximum=MAX_ABS_INPUT)
    top_k = props.get("top_k")
    if top_k is not None:
        for option in top_k.get("anyOf", [top_k]):
            if option.get("type") == "integer":
                option["maximum"] = num_experts


def _tighten(schema: dict[str, Any], input_dim: int, max_rows: int, num_experts: int) -> None:
    for path in _BODY_PATHS:
        operation = schema["paths"].get(path, {}).get("post")
        if operation is None:
            continue
        body = operation["requestBody"]["content"].get("application/json", {}).get("schema")
        if body is not None:
            _tighten_body(body, input_dim, max_rows, num_experts)
        for parameter in operation.get("parameters", []):
            if parameter["name"] == "top_k":
                for option in parameter["schema"].get("anyOf", [parameter["schema"]]):
                    if option.get("type") == "integer":
                        option["maximum"] = num_experts


def _name_the_model(schema: dict[str, Any], model: str, version: str) -> None:
    for path, operations in schema["paths"].items():
        if not path.startswith("/v2/models/"):
            continue
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path" and parameter["name"] == "name":
                    parameter["schema"]["enum"] = [model]
                elif parameter["in"] == "path" and parameter["name"] == "version":
                    parameter["schema"]["enum"] = [version]


def install_openapi(app: FastAPI, serving: ServingState, model_name: str) -> None:
    """Make `app.openapi()` (and /openapi.json) describe the version being served."""
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "base" not in built:
            built["base"] = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
        version = serving.version
        if version is None:
            return built["base"]  # type: ignore[no-any-return]
        if built.get("for") != version.version:
            schema = copy.deepcopy(built["base"])
            m = version.manifest
            _tighten(schema, m.input_dim, serving.settings.max_rows, m.num_experts)
            _name_the_model(schema, model_name, version.version)
            built["for"], built["schema"] = version.version, schema
        return built["schema"]  # type: ignore[no-any-return]

    app.openapi = openapi  # type: ignore[method-assign]
