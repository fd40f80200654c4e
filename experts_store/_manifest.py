"""manifest.json: the one file that says what a store holds (DESIGN.md, "Store layout").

This module reads it: the bytes decoded and validated strictly into a `Manifest`, errors in
one line, and the rows of a republished manifest that did not change taken from the
previous read. The model itself is `experts_store._manifest_model`, re-exported here.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from experts_store._exceptions import ManifestError
from experts_store._manifest_model import (
    LINEAR_LIFT_EXTRA_DIMS,
    MANIFEST_FORMAT_VERSION,
    PACE_CONTEXT_KEY,
    STORE_KINDS,
    ExpertEntry,
    GateSpec,
    Manifest,
    expert_file_name,
    router_file_name,
)
from experts_store._pace import Pace
from experts_store._paced_json import ItemSpans, KnownItems, decode_json_items

__all__ = [
    "LINEAR_LIFT_EXTRA_DIMS",
    "MANIFEST_FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "STORE_KINDS",
    "ExpertEntry",
    "GateSpec",
    "Manifest",
    "ManifestRows",
    "expert_file_name",
    "read_manifest",
    "read_manifest_rows",
    "router_file_name",
]

# The largest manifest.json a store may have; a larger one is refused from its size, unread.
# A K=100,000 store's manifest is ~43 MB (README, "How the expert cache and eviction work"):
# 1 GiB is K ≈ 2.5 million, past any store this reader opens in reasonable time, and a
# reading server holds the text, its decoded objects and the rows (several times the size)
# at once, so a manifest beyond it is a mistake or an attack, not a store.
MAX_MANIFEST_BYTES = 1 << 30


def read_manifest(
    raw: bytes, *, pace: Pace | None = None, root: Path | str | None = None
) -> Manifest:
    """The manifest in `raw` (manifest.json's bytes), validated.

    ManifestError (naming `root`, the store the bytes were read from, when given) if it is
    not JSON or not a valid manifest; its cause is the JSON or pydantic error. JSON types
    are taken strictly: a count of "3", 3.0 or true is refused, naming the field.
    `pace`, when given, is called once per expert row while it is decoded and checked, so a
    thread reading a large store beside a serving event loop hands the GIL over (`Pacer`).
    """
    return read_manifest_rows(raw, pace=pace, root=root)[0]


@dataclass(frozen=True, eq=False)
class ManifestRows:
    """Where a manifest's expert rows lie in the text it was read from, beside the rows as
    validated: what lets a later read of a republished manifest take its unchanged rows as
    they are. Holds the text (43 MB at K=100,000) for as long as it is kept."""

    spans: ItemSpans
    entries: list[ExpertEntry]  # the manifest's own list (a retired version's release empties it)


def read_manifest_rows(
    raw: bytes,
    *,
    pace: Pace | None = None,
    previous: ManifestRows | None = None,
    root: Path | str | None = None,
) -> tuple[Manifest, ManifestRows]:
    """`read_manifest`, and its rows' `ManifestRows`. A row whose text is the same as the row
    of the same index in `previous` is that row's entry, not decoded or checked again: a
    K=100,000 republish that changed no row opened in 0.24 s instead of 1.26 s, refs included
    (benchmarks/RESULTS.md, fifty-ninth session). The manifest's own checks of its rows (ids,
    derived file names, params, each kind's block) run on every row as before."""
    known = None if previous is None else _same_rows(previous)
    try:
        data, spans = decode_json_items(raw, "experts", pace, known)
        context = None if pace is None else {PACE_CONTEXT_KEY: pace}
        # Strict: a JSON value is taken as the type it is, in every block (a count of "3",
        # 3.0 or true is not a count), where pydantic would convert it. One flag on the one
        # validation, no work added per row (a taken row is its entry, as before); the
        # models stay lax for the Python that builds them (a numpy int is an int there).
        manifest = Manifest.model_validate(data, context=context, strict=True)
    except ValidationError as exc:
        raise ManifestError(root=root, message=_validation_message(exc)) from exc
    except ValueError as exc:  # not UTF-8 JSON
        raise ManifestError(root=root, message=f"not valid JSON: {exc}") from exc
    except RecursionError:
        raise ManifestError(root=root, message="JSON nested too deeply") from None
    return manifest, ManifestRows(spans, manifest.experts)


def _validation_message(exc: ValidationError) -> str:
    """pydantic's errors in one line, each as `field: why` (its own text spans lines, echoes
    the input and ends with a link: `momlp serve` prints a refused store in one line). A
    value of the wrong JSON type is shown when it is short: `input_dim: ..., got "3"`."""
    parts = []
    for error in exc.errors()[:3]:
        where = ".".join(str(part) for part in error["loc"])
        why = str(error["msg"]).removeprefix("Value error, ")
        shown = _shown(error.get("input")) if str(error["type"]).endswith("_type") else None
        if shown is not None:
            why += f", got {shown}"
        parts.append(f"{where}: {why}" if where else why)
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _shown(value: Any) -> str | None:
    """A JSON scalar as the manifest has it, when it is short; None for anything else."""
    if value is not None and not isinstance(value, bool | int | float | str):
        return None
    try:
        text = json.dumps(value)
    except ValueError:  # an int past Python's digit limit
        return None
    return text if len(text) <= 40 else None


def _same_rows(previous: ManifestRows) -> KnownItems:
    """The rows of `previous` from row `index` on whose text (commas between them included)
    is the text at `at`. A row's own checks depend on its text alone, so the same text checks
    to the same entry. Runs are found by doubling (1, 2, 4, ... rows, at most `_MAX_RUN`), so
    the text compared is at most about four times the text taken, plus one row for each row
    read anew, whatever changed."""
    entries = list(previous.entries)  # a snapshot: a release empties the list it was given
    spans = previous.spans
    old = spans.text
    count = min(len(entries), len(spans))

    def known(text: str, index: int, at: int) -> tuple[list[ExpertEntry], array[int]] | None:
        taken = 0
        if index < count:
            start = spans.span(index)[0]
            size = 1
            while size <= _MAX_RUN and index + size <= count:
                end = spans.span(index + size - 1)[1]
                if not text.startswith(old[start:end], at):
                    break
                taken, size = size, 2 * size
        if taken == 0:
            return None
        shift = at - start
        bounds = spans.bounds(index, index + taken)
        if shift:
            bounds = array("q", [b + shift for b in bounds])
        return entries[index : index + taken], bounds

    return known


# Rows taken at once, with one call of the pace: ~0.4 ms of comparing at most.
_MAX_RUN = 1024
