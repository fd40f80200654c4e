"""Pydantic models of the Open Inference Protocol v2 metadata and health responses."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = [
    "LiveResponse",
    "ModelMetadata",
    "ReadyResponse",
    "ServerMetadata",
    "TensorMetadata",
    "V2Error",
]


class LiveResponse(BaseModel):
    live: bool


class ReadyResponse(BaseModel):
    ready: bool


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]  # -1 for the batch (and any size known only per request)


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class V2Error(BaseModel):
    """Every non-2xx answer under /v2, as the protocol's clients read it."""

    error: str
