"""The manifest's model: `Manifest`, its expert rows (`ExpertEntry`) and default gate
(`GateSpec`), with the checks each makes of itself, and the names a store's files derive
from their content (DESIGN.md, "Store layout"). Reading manifest.json into it is
`experts_store._manifest`."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from experts_store._arch import ExpertArch
from experts_store._arch_memo import checked_arch, shared_arch_dict
from experts_store._exceptions import UnknownExpert
from experts_store._graph import GraphBlock
from experts_store._hyper import HyperSpec
from experts_store._pace import Pace, no_pace
from experts_store._pmoe import PMoESpec

__all__ = [
    "LINEAR_LIFT_EXTRA_DIMS",
    "MANIFEST_FORMAT_VERSION",
    "PACE_CONTEXT_KEY",
    "STORE_KINDS",
    "ExpertEntry",
    "GateSpec",
    "Manifest",
    "expert_file_name",
    "router_file_name",
]

# Format 2 adds `kind` and `gate`; a format-1 manifest (neither) reads as kind "momlp" with
# the default gate at its top-level temperature. Expert files keep their own FORMAT_VERSION.
MANIFEST_FORMAT_VERSION = 2
# The kinds of store momlp serves (server/kinds registers one model per kind; a test keeps the
# two lists equal). A manifest of another kind still parses: a server refuses it, naming it.
STORE_KINDS = frozenset({"momlp", "graph", "hyper", "pmoe"})
_KIND = re.compile(r"[a-z][a-z0-9_-]{0,63}")
# The coordinates a `lift: "linear"` gate's router rows have beyond the input's [wᵢ, bᵢ, hᵢ, lᵢ]
# (router/_lift.py's LIFT_EXTRA_DIMS; a test keeps the two equal).
LINEAR_LIFT_EXTRA_DIMS = 3

# A row's string formats are checked by pydantic's own (Rust) regex, not by a Python validator
# a row: with the file and params checks moved into the manifest's own pass, validating a
# K=100,000 manifest's rows took 0.47-0.59 s instead of 0.81 s (benchmarks/RESULTS.md,
# fifty-seventh session). Anchored: pydantic searches, where fullmatch matched whole.
_Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# "<algo>:<hex>"; the algorithm is not restricted here, so that a manifest a newer writer
# recorded with another algorithm still opens (Store then falls back to sha256).
_Checksum = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]{1,32}:[0-9a-f]{8,128}$")]
_EXPERT_FILE = re.compile(r"experts/(\d+)-([0-9a-f]{16})\.safetensors")
_ROUTER_FILE = re.compile(r"router-([0-9a-f]{16})\.safetensors")


def expert_file_name(expert_id: int, sha256: str) -> str:
    """Store-relative path of an expert file; derived from id and content, never user input.

    Content-addressed names let a new publish add files without touching the ones the
    previous (possibly still served) manifest references.
    """
    return f"experts/{int(expert_id)}-{sha256[:16]}.safetensors"


def router_file_name(sha256: str) -> str:
    return f"router-{sha256[:16]}.safetensors"


# The key of the pace in pydantic's validation context (read_manifest puts it there).
PACE_CONTEXT_KEY = "momlp.pace"


def _pace_of(info: ValidationInfo) -> Pace:
    context = info.context
    pace = context.get(PACE_CONTEXT_KEY) if isinstance(context, dict) else None
    return pace if pace is not None else no_pace


class ExpertEntry(BaseModel):
    """One row of ``manifest["experts"]``.

    ``checksum`` is the fast checksum ``"<algo>:<hex>"`` (``"xxh3_128:..."``) of the file,
    checked on every load; manifests written before it existed have None.

    A row checks its own fields; that its ``file`` is the name derived from its id and
    sha256, and its ``params`` its arch's, the manifest checks, in the one pass it makes over
    its rows anyway.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Strict: JSON integers only (an id of true or "1" is not one of 0..K-1).
    id: int = Field(ge=0, strict=True)
    file: str
    sha256: _Sha256
    bytes: int = Field(ge=0, strict=True)
    params: int = Field(ge=0, strict=True)
    arch: dict[str, Any]
    checksum: _Checksum | None = None

    # "plain": the memo checks the value itself, and pydantic's own check of a dict[str, Any]
    # would first copy each row's dict, only for the copy to be replaced by the shared one.
    @field_validator("arch", mode="plain", json_schema_input_type=dict[str, Any])
    @classmethod
    def _check_arch(cls, value: Any, info: ValidationInfo) -> dict[str, Any]:
        # The rows' pace goes here: pydantic's Rust core validates all of them in one call
        # that holds the GIL (0.3 s at K=100,000), and this is the one Python it calls a row.
        # Without it a swap under load stalled requests for up to 0.76 s (benchmarks/
        # RESULTS.md, fifty-seventh session).
        _pace_of(info)()
        return shared_arch_dict(value)

    @property  # not cached on the entry: model_copy(update=...) would keep a stale one
    def expert_arch(self) -> ExpertArch:
        return checked_arch(self.arch)


class GateSpec(BaseModel):
    """The store's default gate (manifest format 2): how a row's experts are weighted.

    `score` is what the softmax is taken over, negated: the squared distance to a prototype
    ("sqdist") or the distance itself ("dist", the score the paper's eq. 39 trains with).
    `temperature_source` says how τ was chosen ("default", "config": given to the build,
    "calibrated": fitted on held-out data, with the fit's figures in `calibration`).
    `hierarchy` describes the prototype tree a beam gate walks (branching ν and depth).
    `tree_top_k`: what top_k > 1 means in tree routing: "nearest" (the exact k nearest, as
    format 1 served it) or "beam" (the k best leaves of the soft tree walk, consistent with
    experts trained on the tree's cells; what `momlp build` now writes).
    `lift`: "linear" when the prototypes are a linear router's lifted rows [wᵢ, bᵢ, hᵢ, lᵢ]
    (router/_lift.py): the server routes [x, 1, 0, 0], so exact routing serves
    softmax((wᵢᵀx + bᵢ)/τ) with τ = temperature / 2 exactly; tree routing on lifted points
    is an approximation of it. None: plain prototypes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    score: Literal["sqdist", "dist"] = "sqdist"
    temperature: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    temperature_source: Literal["default", "config", "calibrated"] = "default"
    calibration: dict[str, Any] | None = None
    hierarchy: dict[str, int] | None = None
    tree_top_k: Literal["nearest", "beam"] = "nearest"
    lift: Literal["linear"] | None = None


class Manifest(BaseModel):
    """The store's manifest.json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int
    store_version: str = Field(min_length=1, max_length=128)
    created_at: str
    task: Literal["regression", "classification"]
    input_dim: int = Field(ge=1)
    output_dim: int = Field(ge=1)
    routing: Literal["tree", "exact"]
    branching: int = Field(ge=2)
    num_experts: int = Field(ge=0)  # >= 1 for kind "momlp"; a hyper store has none
    temperature: float = Field(default=1.0, gt=0)
    router_file: str | None = "router.safetensors"  # None: a hyper store without prototypes
    experts: list[ExpertEntry]
    extra: dict[str, Any] = Field(default_factory=dict)
    kind: str = "momlp"
    gate: GateSpec | None = None
    hyper: HyperSpec | None = None  # the block of kind "hyper" (experts_store/_hyper.py)
    pmoe: PMoESpec | None = None  # kind "pmoe": patch layout, routing, gating
    graph: GraphBlock | None = None  # kind "graph" only: its DAG of nodes (_graph.py)

    @field_validator("format_version")
    @classmethod
    def _check_format(cls, value: int) -> int:
        if not 1 <= value <= MANIFEST_FORMAT_VERSION:
            raise ValueError(
                f"format_version {value} is not one this momlp reads (1 to "
                f"{MANIFEST_FORMAT_VERSION}); was the store written by a newer momlp?"
            )
        return value

    @field_validator("kind")
    @classmethod
    def _check_kind(cls, value: str) -> str:
        if not _KIND.fullmatch(value):
            raise ValueError(f"kind {value!r} is not a lowercase name (a-z, 0-9, '_', '-')")
        return value

    @model_validator(mode="after")
    def _check_gate(self) -> Manifest:
        # The top-level temperature stays for format-1 readers; it must not disagree.
        if self.gate is not None and self.gate.temperature != self.temperature:
            raise ValueError(
                f"gate.temperature {self.gate.temperature!r} differs from temperature "
                f"{self.temperature!r}"
            )
        return self

    @property
    def gate_spec(self) -> GateSpec:
        """The gate block, or for a format-1 manifest the gate it was served with."""
        if self.gate is not None:
            return self.gate
        return GateSpec(temperature=self.temperature)

    @model_validator(mode="after")
    def _check_hyper(self) -> Manifest:
        if (self.kind == "hyper") != (self.hyper is not None):
            raise ValueError("a manifest has the hyper block exactly when its kind is 'hyper'")
        if self.hyper is not None and (
            self.hyper.input_dim != self.input_dim or self.hyper.output_dim != self.output_dim
        ):
            raise ValueError("hyper block dims differ from the manifest's")
        if self.router_file is None and self.kind == "momlp":
            raise ValueError("a store of kind 'momlp' needs its router_file")
        return self

    @field_validator("router_file")
    @classmethod
    def _check_router_file(cls, value: str | None) -> str | None:
        if value is not None and not _ROUTER_FILE.fullmatch(value):
            raise ValueError(f"router_file {value!r} is not of the form router-<sha16>.safetensors")
        return value

    @field_validator("store_version")
    @classmethod
    def _check_version(cls, value: str) -> str:
        if not re.fullmatch(r"[0-9A-Za-z._-]+", value):
            raise ValueError("store_version may hold only letters, digits, '.', '_' and '-'")
        return value

    @model_validator(mode="after")
    def _check_experts(self, info: ValidationInfo) -> Manifest:
        ids = [entry.id for entry in self.experts]
        if self.kind == "momlp" and not ids:
            raise ValueError("a store of kind 'momlp' needs at least one expert")
        # Lengths first: a num_experts of 10^9 must not build a list of 10^9 ints to compare.
        if len(ids) != self.num_experts or ids != list(range(self.num_experts)):
            raise ValueError(
                f"expert ids must be exactly 0..{self.num_experts - 1} in order, got "
                f"{ids[:10]}{'...' if len(ids) > 10 else ''}"
            )
        pace = _pace_of(info)
        momlp = self.kind == "momlp"
        misfit: str | None = None  # the first momlp row whose arch maps other dims
        # Rows of one arch share its dict (`shared_arch_dict`): its figures are worked out
        # when the dict changes from the row before, not once a row (0.1 s at K=100,000).
        arch_dict: dict[str, Any] | None = None
        params = 0
        for entry in self.experts:
            pace()  # once per row: a manifest's rows are its long loop
            if entry.arch is not arch_dict:
                arch_dict, arch = entry.arch, entry.expert_arch
                params = arch.num_parameters()
                # Other kinds' experts map their own spaces (a graph node's inputs, a patch);
                # each kind's own block checks them below. Raised after those checks: for a
                # pmoe manifest relabelled "momlp", the error to name is that kind and block
                # disagree. A row like the one before it cannot be the first misfit.
                if misfit is None and momlp and (
                    arch.input_dim != self.input_dim or arch.output_dim != self.output_dim
                ):
                    misfit = (
                        f"expert {entry.id}: arch maps {arch.input_dim} -> {arch.output_dim}, "
                        f"store maps {self.input_dim} -> {self.output_dim}"
                    )
            # The exact derived name also rules out absolute paths and "..": nothing outside
            # the store's experts/ directory can be named.
            if entry.file != expert_file_name(entry.id, entry.sha256):
                raise ValueError(
                    f"expert {entry.id}: file {entry.file!r} is not the derived name "
                    f"{expert_file_name(entry.id, entry.sha256)!r}"
                )
            if entry.params != params:
                raise ValueError(f"expert {entry.id}: params does not match its arch")
        if self.kind == "pmoe" or self.pmoe is not None:
            if self.pmoe is None or self.kind != "pmoe":
                raise ValueError("kind 'pmoe' and the pmoe block go together")
            self.pmoe.check_store(
                input_dim=self.input_dim,
                output_dim=self.output_dim,
                archs=[entry.expert_arch for entry in self.experts],
            )
        if (self.kind == "graph") != (self.graph is not None):
            raise ValueError("a store of kind 'graph' needs a graph block, and only it has one")
        if self.graph is not None:
            self.graph.check(
                self.input_dim, self.output_dim, [e.expert_arch for e in self.experts]
            )
        if misfit is not None:
            raise ValueError(misfit)
        return self

    @property
    def referenced_files(self) -> set[str]:
        """Store-relative paths of every file this manifest needs; publishing keeps them and
        removes the unreferenced."""
        return {entry.file for entry in self.experts} | self.non_expert_files

    @property
    def non_expert_files(self) -> set[str]:
        """Store-relative paths of the files this manifest needs besides its experts' (the
        routers, a kind's own files): a few, where experts may be 100,000. A kind whose block
        names more files adds them here."""
        files: set[str] = set()
        if self.router_file is not None:
            files.add(self.router_file)
        if self.hyper is not None:
            files |= self.hyper.files
        if self.graph is not None:
            files |= self.graph.router_files
        return files

    @property
    def total_expert_bytes(self) -> int:
        return sum(entry.bytes for entry in self.experts)

    @property
    def max_expert_bytes(self) -> int:
        return max((entry.bytes for entry in self.experts), default=0)

    @property
    def total_params(self) -> int:
        return sum(entry.params for entry in self.experts)

    def expert(self, expert_id: int) -> ExpertEntry:
        """The row of ``expert_id``; UnknownExpert when the store has no such expert."""
        if isinstance(expert_id, bool) or not 0 <= expert_id < self.num_experts:
            raise UnknownExpert(expert_id=int(expert_id), num_experts=self.num_experts)
        return self.experts[expert_id]
