"""`momlp store materialize`: a prototype-conditioned hyper store written out as an ordinary
K-expert store (kind "momlp"): expert k = θ_k = f(p_k) in the store's expert format, the same
router, exact routing. The outputs of the two stores agree bit for bit (same θ, same forward).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from experts_store._exceptions import StoreError
from experts_store._hyper import HyperSpec
from experts_store._hypernet import FrozenHyperNetwork, load_conditions, theta_module
from experts_store._manifest import GateSpec, Manifest
from experts_store._store import Store
from experts_store._writer import StoreWriter

__all__ = ["materialize_store"]


def materialize_store(source: Path | str, out: Path | str) -> Manifest:
    """Write the K experts a prototype-conditioned hyper store stands for; returns the new
    store's manifest (StoreError when `source` is not such a store, or when no store can be
    written at `out`: a file, the source store itself, a directory that cannot be created)."""
    store = Store.open(source)
    spec = store.manifest.hyper
    if spec is None or spec.condition_source != "prototype" or spec.conditions is None:
        raise StoreError(f"{store.root} is not a prototype-conditioned hyper store")
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise StoreError(f"{target} exists and is not a directory")
    if target.exists() and target.resolve() == store.root.resolve():
        # Publishing there would replace the hyper store's manifest with the K-expert one.
        raise StoreError(f"{target} is the source store; materialize into another directory")
    f = spec.hypernetwork
    net = FrozenHyperNetwork.load(store.root / f.file, expected_sha256=f.sha256)
    table, _ = load_conditions(store.root / spec.conditions.file, spec.conditions.sha256)
    try:
        return _publish_experts(store, spec, net, table, target)
    except OSError as exc:
        raise StoreError(f"cannot write a store at {target}: {exc.strerror or exc}") from exc


def _publish_experts(
    store: Store, spec: HyperSpec, net: FrozenHyperNetwork, table: torch.Tensor, out: Path
) -> Manifest:
    manifest = store.manifest
    with StoreWriter(out) as writer:
        shutil.copyfile(store.router_path, writer.router_path)
        for k in range(table.shape[0]):
            # One condition per forward, as the serving actors generate it: the same bits.
            flat = net.flat(table[k : k + 1])[0]
            writer.add_expert(k, theta_module(flat, spec))
        return writer.publish(
            task=manifest.task, input_dim=manifest.input_dim, output_dim=manifest.output_dim,
            routing="exact", branching=manifest.branching,
            gate=GateSpec(temperature=manifest.temperature),
            extra={"materialized_from": manifest.store_version},
        )
