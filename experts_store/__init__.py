"""Expert MLPs, their one-file safetensors format, the store on disk and the expert cache.

Names are imported on first use, so that `momlp --help` (whose command registration
imports this package) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from experts_store._arch import ACTIVATIONS, Activation, ExpertArch, paper_parameter_count
    from experts_store._cache import ExpertCache
    from experts_store._cache_types import (
        CACHE_POLICIES,
        CachePolicy,
        CacheStats,
        Clock,
        ExpertLoader,
        Lease,
        MonotonicClock,
    )
    from experts_store._exceptions import (
        CacheBusy,
        CacheError,
        ExpertChecksumError,
        ExpertFileMissing,
        ExpertFormatError,
        ExpertLoadError,
        ExpertTooLarge,
        ManifestError,
        StoreError,
        StoreNotFound,
        UnknownExpert,
    )
    from experts_store._format import FORMAT_VERSION, ExpertFile, save_expert
    from experts_store._frozen import ROW_ALIGN, FrozenExpert
    from experts_store._graph import GraphBlock, GraphNodeEntry, node_ref
    from experts_store._host_tier import HostTier, HostTierStats
    from experts_store._hostbuf import HostBufferPool
    from experts_store._hyper import (
        ConditionTable,
        HyperFile,
        HyperSpec,
        PrimaryArch,
        ThetaSlotSpec,
        conditions_file_name,
        hypernetwork_file_name,
    )
    from experts_store._hypernet import (
        FrozenHyperNetwork,
        GeneratedRef,
        GeneratorRef,
        condition_bytes,
        condition_key,
        load_conditions,
        own_file_problem,
        save_conditions,
        save_hypernetwork,
        theta_expert,
        theta_file_bytes,
        theta_module,
        verify_hyper_files,
    )
    from experts_store._load import load_expert, load_frozen_expert
    from experts_store._manifest import (
        MANIFEST_FORMAT_VERSION,
        ExpertEntry,
        GateSpec,
        Manifest,
        ManifestRows,
        read_manifest,
        read_manifest_rows,
    )
    from experts_store._materialize import materialize_store
    from experts_store._model import ExpertMLP
    from experts_store._pace import Pace, Pacer, no_pace
    from experts_store._paced_json import (
        ItemSpans,
        KnownItems,
        decode_json,
        decode_json_items,
        decode_json_member,
    )
    from experts_store._pmoe import (
        PATCH_ALIGN,
        PMOE_ROUTER_TENSOR,
        ImageLayout,
        PatchLayout,
        PMoESpec,
    )
    from experts_store._progress import LOG_INTERVAL_S, progress_bar
    from experts_store._ref import ExpertRef, ExpertRefLoader
    from experts_store._store import Store, StoreExpertLoader, StoreProblem
    from experts_store._writer import StoreWriter

__all__ = [
    "materialize_store",
    "LOG_INTERVAL_S",
    "progress_bar",
    "ConditionTable",
    "HyperFile",
    "HyperSpec",
    "PrimaryArch",
    "ThetaSlotSpec",
    "conditions_file_name",
    "hypernetwork_file_name",
    "FrozenHyperNetwork",
    "GeneratedRef",
    "GeneratorRef",
    "condition_bytes",
    "condition_key",
    "load_conditions",
    "save_conditions",
    "own_file_problem",
    "save_hypernetwork",
    "theta_expert",
    "theta_file_bytes",
    "theta_module",
    "verify_hyper_files",
    "ACTIVATIONS",
    "CACHE_POLICIES",
    "FORMAT_VERSION",
    "Activation",
    "CacheBusy",
    "CacheError",
    "CachePolicy",
    "CacheStats",
    "Clock",
    "ExpertArch",
    "ExpertCache",
    "ExpertChecksumError",
    "ExpertEntry",
    "ExpertFile",
    "ExpertFileMissing",
    "ExpertFormatError",
    "ExpertLoadError",
    "ExpertLoader",
    "ExpertMLP",
    "ExpertRef",
    "ExpertRefLoader",
    "ExpertTooLarge",
    "FrozenExpert",
    "ROW_ALIGN",
    "GraphBlock",
    "GraphNodeEntry",
    "HostBufferPool",
    "HostTier",
    "HostTierStats",
    "Lease",
    "Manifest",
    "MANIFEST_FORMAT_VERSION",
    "Pace",
    "Pacer",
    "no_pace",
    "read_manifest",
    "read_manifest_rows",
    "ManifestRows",
    "decode_json",
    "decode_json_items",
    "decode_json_member",
    "ItemSpans",
    "KnownItems",
    "GateSpec",
    "ImageLayout",
    "PATCH_ALIGN",
    "PMOE_ROUTER_TENSOR",
    "PMoESpec",
    "PatchLayout",
    "ManifestError",
    "MonotonicClock",
    "Store",
    "StoreError",
    "StoreExpertLoader",
    "StoreNotFound",
    "StoreProblem",
    "StoreWriter",
    "UnknownExpert",
    "load_expert",
    "load_frozen_expert",
    "node_ref",
    "paper_parameter_count",
    "save_expert",
]

_HOMES = {
    "LOG_INTERVAL_S": "experts_store._progress",
    "progress_bar": "experts_store._progress",
    "ACTIVATIONS": "experts_store._arch",
    "Activation": "experts_store._arch",
    "ExpertArch": "experts_store._arch",
    "paper_parameter_count": "experts_store._arch",
    "CACHE_POLICIES": "experts_store._cache_types",
    "CachePolicy": "experts_store._cache_types",
    "CacheStats": "experts_store._cache_types",
    "Clock": "experts_store._cache_types",
    "ExpertCache": "experts_store._cache",
    "ExpertLoader": "experts_store._cache_types",
    "Lease": "experts_store._cache_types",
    "MonotonicClock": "experts_store._cache_types",
    "CacheBusy": "experts_store._exceptions",
    "CacheError": "experts_store._exceptions",
    "ExpertChecksumError": "experts_store._exceptions",
    "ExpertFileMissing": "experts_store._exceptions",
    "ExpertFormatError": "experts_store._exceptions",
    "ExpertLoadError": "experts_store._exceptions",
    "ExpertTooLarge": "experts_store._exceptions",
    "ManifestError": "experts_store._exceptions",
    "StoreError": "experts_store._exceptions",
    "StoreNotFound": "experts_store._exceptions",
    "UnknownExpert": "experts_store._exceptions",
    "FORMAT_VERSION": "experts_store._format",
    "ExpertFile": "experts_store._format",
    "load_expert": "experts_store._load",
    "load_frozen_expert": "experts_store._load",
    "FrozenExpert": "experts_store._frozen",
    "ROW_ALIGN": "experts_store._frozen",
    "save_expert": "experts_store._format",
    "HostBufferPool": "experts_store._hostbuf",
    "HostTier": "experts_store._host_tier",
    "HostTierStats": "experts_store._host_tier",
    "GraphBlock": "experts_store._graph",
    "GraphNodeEntry": "experts_store._graph",
    "node_ref": "experts_store._graph",
    "ExpertEntry": "experts_store._manifest",
    "Manifest": "experts_store._manifest",
    "MANIFEST_FORMAT_VERSION": "experts_store._manifest",
    "GateSpec": "experts_store._manifest",
    "read_manifest": "experts_store._manifest",
    "read_manifest_rows": "experts_store._manifest",
    "ManifestRows": "experts_store._manifest",
    "Pace": "experts_store._pace",
    "Pacer": "experts_store._pace",
    "no_pace": "experts_store._pace",
    "decode_json": "experts_store._paced_json",
    "decode_json_member": "experts_store._paced_json",
    "decode_json_items": "experts_store._paced_json",
    "ItemSpans": "experts_store._paced_json",
    "KnownItems": "experts_store._paced_json",
    "ExpertMLP": "experts_store._model",
    "PATCH_ALIGN": "experts_store._pmoe",
    "PMOE_ROUTER_TENSOR": "experts_store._pmoe",
    "ImageLayout": "experts_store._pmoe",
    "PatchLayout": "experts_store._pmoe",
    "PMoESpec": "experts_store._pmoe",
    "ExpertRef": "experts_store._ref",
    "ExpertRefLoader": "experts_store._ref",
    "Store": "experts_store._store",
    "StoreExpertLoader": "experts_store._store",
    "StoreProblem": "experts_store._store",
    "StoreWriter": "experts_store._writer",
    "materialize_store": "experts_store._materialize",
    "ConditionTable": "experts_store._hyper",
    "HyperFile": "experts_store._hyper",
    "HyperSpec": "experts_store._hyper",
    "PrimaryArch": "experts_store._hyper",
    "ThetaSlotSpec": "experts_store._hyper",
    "conditions_file_name": "experts_store._hyper",
    "hypernetwork_file_name": "experts_store._hyper",
    "FrozenHyperNetwork": "experts_store._hypernet",
    "GeneratedRef": "experts_store._hypernet",
    "GeneratorRef": "experts_store._hypernet",
    "condition_bytes": "experts_store._hypernet",
    "condition_key": "experts_store._hypernet",
    "load_conditions": "experts_store._hypernet",
    "own_file_problem": "experts_store._hypernet",
    "save_conditions": "experts_store._hypernet",
    "save_hypernetwork": "experts_store._hypernet",
    "theta_expert": "experts_store._hypernet",
    "theta_file_bytes": "experts_store._hypernet",
    "theta_module": "experts_store._hypernet",
    "verify_hyper_files": "experts_store._hypernet",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'experts_store' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
