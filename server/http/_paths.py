"""The v1 paths that more than one module names: the hot dispatch, the FastAPI routes that
document them, and the OpenAPI rewrite of their bodies."""

from __future__ import annotations

__all__ = ["PREDICT_PATH", "ROUTE_PATH"]

PREDICT_PATH = "/v1/predict"
ROUTE_PATH = "/v1/route"
