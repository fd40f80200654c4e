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
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.http._paths import PREDICT_PATH, ROUTE_PATH
from server.kinds import GATE_OPTIONS, HyperSection
from server.serving import ServingState

__all__ = ["MAX_ABS_INPUT", "inline_defs", "install_openapi"]

# The router refuses |x| above this: squared distances would overflow float32.
MAX_ABS_INPUT = 1e15
_BODY_PATHS = (PREDICT_PATH, ROUTE_PATH)


def inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `$defs` references written in place: an operation's
    inline request body cannot point into a `$defs` of its own."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {key: walk(value) for key, value in node.items() if key != "$defs"}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    inlined: dict[str, Any] = walk(schema)
    return inlined


@dataclass(frozen=True)
class _Limits:
    """What the server enforces on a request to the version served."""

    input_dim: int
    max_rows: int
    max_top_k: int
    max_beam: int
    beam_levels: int
    temperature: tuple[float, float]  # [τ / ratio, τ · ratio] around the store's τ
    # The kind's `options_taken`: a request the schema allows is one the server accepts.
    options: frozenset[str] = GATE_OPTIONS
    # A kind that takes conditions: their width, and the names a request may give (None:
    # unknown or too many to list; empty: the store names none).
    condition_dim: int | None = None
    condition_names: tuple[str, ...] | None = None


_GATE_FIELDS = ("temperature", "min_weight", "top_p", "beam", "score")


def _integer_options(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in node.get("anyOf", [node]) if o.get("type") == "integer"]


def _tighten_gate(gate: dict[str, Any], limits: _Limits) -> None:
    props = gate.get("properties", {})
    for name in _GATE_FIELDS:
        if name not in limits.options:
            props.pop(name, None)  # an empty gate ({}) stays: every kind takes it
    for option in props.get("temperature", {}).get("anyOf", []):
        if option.get("type") == "number":
            option.pop("exclusiveMinimum", None)
            option["minimum"], option["maximum"] = limits.temperature
    for option in props.get("beam", {}).get("anyOf", []):
        if option.get("type") == "array":
            option["maxItems"] = limits.beam_levels
            option["items"]["maximum"] = limits.max_beam


def _tighten_body(schema: dict[str, Any], limits: _Limits) -> None:
    props = schema.get("properties", {})
    if "conditions" not in limits.options:
        for name in ("conditions", "condition", "condition_ids"):
            props.pop(name, None)
    else:
        _tighten_conditions(schema, limits)
    if "mode" not in limits.options:
        props.pop("mode", None)
    inputs = props.get("inputs")
    if inputs is not None:
        inputs["maxItems"] = limits.max_rows
        row = inputs["items"]
        row["minItems"] = row["maxItems"] = limits.input_dim
        row["items"].update(minimum=-MAX_ABS_INPUT, maximum=MAX_ABS_INPUT)
    for option in _integer_options(props.get("top_k", {})):
        option["maximum"] = limits.max_top_k if "top_k" in limits.options else 1
    for option in props.get("gate", {}).get("anyOf", []):
        if option.get("type") == "object":
            _tighten_gate(option, limits)
    if "top_k" in limits.options and "beam" in limits.options:
        # A beam walk and top_k > 1 are two ways to pick several experts: not both at once.
        schema["not"] = {
            "required": ["top_k", "gate"],
            "properties": {
                "top_k": {"type": "integer", "minimum": 2},
                "gate": {"type": "object", "required": ["beam"],
                         "properties": {"beam": {"type": "array"}}},
            },
        }


def _tighten_conditions(schema: dict[str, Any], limits: _Limits) -> None:
    """A kind that takes conditions needs one of the three ways of giving them (a request
    with none is refused), each row's of the store's width, and named ones it has."""
    props = schema.get("properties", {})
    if limits.condition_names is not None and not limits.condition_names:
        props.pop("condition_ids", None)  # the store names no condition
    given = [name for name in ("conditions", "condition", "condition_ids") if name in props]
    schema["anyOf"] = [
        {"required": [name], "properties": {name: {"type": "array"}}} for name in given
    ]
    for name in given:
        array = next(o for o in props[name].get("anyOf", [props[name]]) if o.get("type") == "array")
        if name == "conditions" and limits.condition_dim is not None:
            row = array["items"]
            row["minItems"] = row["maxItems"] = limits.condition_dim
        elif name == "condition" and limits.condition_dim is not None:
            array["minItems"] = array["maxItems"] = limits.condition_dim
        elif name == "condition_ids" and limits.condition_names:
            array["items"]["enum"] = list(limits.condition_names)


def _beam_pattern(max_beam: int, levels: int) -> str:
    """A query's beam ("2,2,2") as the server takes it: 1 to `levels` widths of 1..max_beam."""
    width = _up_to(max_beam)
    return f"^{width}(,{width}){{0,{levels - 1}}}$"


def _up_to(m: int) -> str:
    """A regular expression of the whole numbers 1..m, written without leading zeros."""
    digits = str(m)
    parts = ["[1-9]" + "[0-9]" * (n - 1) for n in range(1, len(digits))]
    for i, digit in enumerate(int(d) for d in digits):
        lowest = 1 if i == 0 else 0
        if digit > lowest:
            rest = "[0-9]" * (len(digits) - i - 1)
            parts.append(f"{digits[:i]}[{lowest}-{digit - 1}]{rest}")
    parts.append(digits)
    return "(?:" + "|".join(parts) + ")"


def _tighten(schema: dict[str, Any], limits: _Limits) -> None:
    for path in _BODY_PATHS:
        operation = schema["paths"].get(path, {}).get("post")
        if operation is None:
            continue
        content = operation["requestBody"]["content"]
        body = content.get("application/json", {}).get("schema")
        if body is not None:
            _tighten_body(body, limits)
        if "conditions" in limits.options:
            # Conditions come in a JSON body only: a binary body is always refused.
            for media in [media for media in content if media != "application/json"]:
                del content[media]
        # A binary body's gate comes in the query: the same options as a JSON body's.
        operation["parameters"] = [
            parameter for parameter in operation.get("parameters", [])
            if parameter["name"] not in GATE_OPTIONS - {"top_k"} - limits.options
        ]
        for parameter in operation["parameters"]:
            options = parameter["schema"].get("anyOf", [parameter["schema"]])
            if parameter["name"] == "top_k":
                top_k = limits.max_top_k if "top_k" in limits.options else 1
                for option in _integer_options(parameter["schema"]):
                    option["maximum"] = top_k
            elif parameter["name"] == "temperature":
                for option in options:
                    if option.get("type") == "number":  # as the JSON gate's
                        option.pop("exclusiveMinimum", None)
                        option["minimum"], option["maximum"] = limits.temperature
            elif parameter["name"] == "beam":
                for option in options:
                    if option.get("type") == "string":  # as the JSON gate's widths and levels
                        option["pattern"] = _beam_pattern(limits.max_beam, limits.beam_levels)


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


def _condition_limits(hyper: HyperSection | None) -> dict[str, Any]:
    if hyper is None:
        return {}
    names = hyper.condition_ids
    # The section lists the first 1,000 names: a full list may be cut short, so no enum.
    listed = tuple(names) if len(names) < _LISTED_NAMES else None
    return {"condition_dim": hyper.condition_dim, "condition_names": listed}


_LISTED_NAMES = 1000


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
            m, model, settings = version.manifest, version.model, serving.settings
            tau, ratio = m.gate_spec.temperature, settings.max_temperature_ratio
            limits = _Limits(
                input_dim=m.input_dim,
                max_rows=settings.max_rows,
                max_top_k=min(m.num_experts, settings.max_top_k),
                max_beam=settings.max_beam,
                beam_levels=model.beam_levels,
                temperature=(tau / ratio, tau * ratio),
                options=model.options_taken,
                **_condition_limits(model.model_section().hyper),
            )
            _tighten(schema, limits)
            _name_the_model(schema, model_name, version.version)
            built["for"], built["schema"] = version.version, schema
        return built["schema"]  # type: ignore[no-any-return]

    app.openapi = openapi  # type: ignore[method-assign]
