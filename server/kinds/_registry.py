"""Kind name → how to open a store of that kind; the server serves only kinds listed here."""

from __future__ import annotations

from collections.abc import Callable

from experts_store import Pace, Store, no_pace
from server._exceptions import StoreNotServable, UnknownStoreKind
from server.kinds._graph import GraphModel
from server.kinds._hyper import HyperModel
from server.kinds._momlp import MomlpModel
from server.kinds._pmoe import PatchModel
from server.kinds._types import ModelMismatch, ServedModel

__all__ = ["KINDS", "open_model"]

# One entry per kind; a kind is its planner/combiner (a ServedModel), opened from its store.
KINDS: dict[str, Callable[[Store, Pace], ServedModel]] = {
    MomlpModel.kind: MomlpModel.open,
    HyperModel.kind: HyperModel.open,
    PatchModel.kind: PatchModel.open,
    GraphModel.kind: GraphModel.open,
}


def open_model(store: Store, pace: Pace = no_pace) -> ServedModel:
    """The served form of `store` (blocking reads); UnknownStoreKind naming its kind. `pace`
    is called once per expert in its passes over the store's experts (`Pacer`).

    A kind's model refuses parts that do not fit together with ModelMismatch (a ValueError:
    its constructor is also called by tests and benchmarks, which have no store); here that
    is the store's fault, StoreNotServable, so `momlp serve` prints one line and a reload
    keeps the served version. Files that cannot be read are the openers' own errors
    (StoreError, RouterError), each naming its file, but for a hyper store's f and
    conditions table, whose loader's errors would call them "expert -1": a ModelMismatch
    that names them."""
    kind = store.manifest.kind
    opener = KINDS.get(kind)
    if opener is None:
        raise UnknownStoreKind(kind=kind, known=sorted(KINDS))
    try:
        return opener(store, pace)
    except ModelMismatch as exc:
        raise StoreNotServable(kind=kind, reason=str(exc)) from exc
