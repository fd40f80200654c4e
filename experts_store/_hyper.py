"""The manifest block of a store of kind "hyper": a hypernetwork f that generates, for each
condition I, every weight θ_I of a small primary network g(x; θ_I) (paper 001).

    manifest.hyper.input_dim          m1: the columns of x
    manifest.hyper.condition_dim      m2: the columns of a condition I
    manifest.hyper.primary            g's widths [m1, ..., out], activation, bias
    manifest.hyper.hypernetwork       f's file (hyper-<sha16>.safetensors) and its widths
    manifest.hyper.layout             where each of g's tensors sits in f's flat output
    manifest.hyper.conditions         optional table of named conditions
                                      (conditions-<sha16>.safetensors; ids in its metadata)

A hyper store holds no expert files: θ_I is generated on a serving actor when a condition is
first used, and a `momlp store materialize` (or `POST /v1/generate`) writes θ_I as an ordinary
expert file (a PReLU MLP with γ = 0, zero biases where g has none).
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from experts_store._arch import ExpertArch

__all__ = [
    "ConditionTable",
    "HyperFile",
    "HyperSpec",
    "PrimaryArch",
    "ThetaSlotSpec",
    "conditions_file_name",
    "hypernetwork_file_name",
]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_HYPER_FILE = re.compile(r"hyper-([0-9a-f]{16})\.safetensors")
_CONDITIONS_FILE = re.compile(r"conditions-([0-9a-f]{16})\.safetensors")


def hypernetwork_file_name(sha256: str) -> str:
    """Store-relative name of a hypernetwork file, derived from its content."""
    return f"hyper-{sha256[:16]}.safetensors"


def conditions_file_name(sha256: str) -> str:
    """Store-relative name of a named-conditions table, derived from its content."""
    return f"conditions-{sha256[:16]}.safetensors"


class _Block(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _File(_Block):
    file: str
    sha256: str
    bytes: int = Field(ge=1)

    @field_validator("sha256")
    @classmethod
    def _check_sha256(cls, value: str) -> str:
        if not _SHA256.fullmatch(value):
            raise ValueError("sha256 must be 64 lowercase hex digits")
        return value


class ThetaSlotSpec(_Block):
    """One tensor of g inside f's flat output: `name` (layers.{i}.weight|bias), `shape`
    ([out, in] for a weight, [out] for a bias) and the offset of its first value."""

    name: str
    shape: list[int]
    offset: int = Field(ge=0)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class PrimaryArch(_Block):
    """g: widths [m1, hidden..., out], ReLU between layers, biases or not (the paper: none)."""

    widths: list[int] = Field(min_length=2)
    activation: Literal["relu"] = "relu"
    bias: bool = False

    @field_validator("widths")
    @classmethod
    def _check_widths(cls, value: list[int]) -> list[int]:
        if any(w < 1 for w in value):
            raise ValueError(f"every width must be >= 1, got {value}")
        return value

    def layout(self) -> list[ThetaSlotSpec]:
        """Row-major tensors one after the other, in layer order, weight before bias (the
        order `trainer.hyper.PrimarySpec.layout` trains with)."""
        slots: list[ThetaSlotSpec] = []
        offset = 0
        for i, (fan_in, fan_out) in enumerate(zip(self.widths[:-1], self.widths[1:], strict=True)):
            slots.append(ThetaSlotSpec(name=f"layers.{i}.weight", shape=[fan_out, fan_in],
                                       offset=offset))
            offset += fan_out * fan_in
            if self.bias:
                slots.append(ThetaSlotSpec(name=f"layers.{i}.bias", shape=[fan_out], offset=offset))
                offset += fan_out
        return slots

    def expert_arch(self) -> ExpertArch:
        """θ_I as a store expert: the same widths, PReLU with γ = 0 (exactly ReLU)."""
        return ExpertArch(widths=tuple(self.widths), batchnorm=False, prelu_init=0.0)


class HyperFile(_File):
    """f: a ReLU MLP condition [m2] → θ [P]; `widths` = [m2, width..., P]."""

    params: int = Field(ge=1)
    widths: list[int] = Field(min_length=2)

    @model_validator(mode="after")
    def _check(self) -> HyperFile:
        match = _HYPER_FILE.fullmatch(self.file)
        if match is None or not self.sha256.startswith(match.group(1)):
            raise ValueError(f"hypernetwork file {self.file!r} is not hyper-<sha16>.safetensors")
        params = sum(a * b + b for a, b in zip(self.widths[:-1], self.widths[1:], strict=True))
        if params != self.params:
            raise ValueError(f"hypernetwork params {self.params} do not match widths {self.widths}")
        return self


class ConditionTable(_File):
    """`count` named conditions [count, m2] (tensor "conditions"; ids in the metadata)."""

    count: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> ConditionTable:
        match = _CONDITIONS_FILE.fullmatch(self.file)
        if match is None or not self.sha256.startswith(match.group(1)):
            raise ValueError(f"conditions file {self.file!r} is not conditions-<sha16>.safetensors")
        return self


class HyperSpec(_Block):
    """The `hyper` block of a manifest of kind "hyper" (see the module docstring).

    `condition_source`: "request" (each request names its conditions) or "prototype" (the
    table holds K prototypes; a row is routed to the nearest and served by g(·; f(p_k))).
    """

    input_dim: int = Field(ge=1)
    condition_dim: int = Field(ge=1)
    output_dim: int = Field(ge=1)
    primary: PrimaryArch
    hypernetwork: HyperFile
    layout: list[ThetaSlotSpec]
    conditions: ConditionTable | None = None
    condition_source: Literal["request", "prototype"] = "request"

    @model_validator(mode="after")
    def _check(self) -> HyperSpec:
        widths = self.primary.widths
        if widths[0] != self.input_dim or widths[-1] != self.output_dim:
            raise ValueError(
                f"primary maps {widths[0]} -> {widths[-1]}, the block {self.input_dim} -> "
                f"{self.output_dim}"
            )
        if self.layout != self.primary.layout():
            raise ValueError("layout is not the primary's (row-major, layer order, weight first)")
        f_widths = self.hypernetwork.widths
        if f_widths[0] != self.condition_dim or f_widths[-1] != self.theta_size:
            raise ValueError(
                f"hypernetwork maps {f_widths[0]} -> {f_widths[-1]}, expected "
                f"{self.condition_dim} -> {self.theta_size}"
            )
        if self.condition_source == "prototype":
            if self.conditions is None:
                raise ValueError("condition_source 'prototype' needs the conditions table")
            if self.condition_dim != self.input_dim:
                raise ValueError("prototype conditions live in the input space: m2 must be m1")
        return self

    @property
    def theta_size(self) -> int:
        """P: the values of f's output, |θ| in parameters."""
        return sum(slot.numel for slot in self.layout)

    @property
    def expert_arch(self) -> ExpertArch:
        return self.primary.expert_arch()

    @property
    def theta_nbytes(self) -> int:
        """Bytes one θ_I occupies on a device, as the expert the actors cache."""
        return self.expert_arch.nbytes()

    @property
    def files(self) -> set[str]:
        named = {self.hypernetwork.file}
        if self.conditions is not None:
            named.add(self.conditions.file)
        return named
