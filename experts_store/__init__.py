"""Expert MLPs, their one-file safetensors format, the store on disk and the expert cache."""

from __future__ import annotations

from experts_store._arch import ExpertArch, paper_parameter_count
from experts_store._cache import (
    CacheStats,
    Clock,
    ExpertCache,
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
from experts_store._format import FORMAT_VERSION, ExpertFile, load_expert, save_expert
from experts_store._hostbuf import HostBufferPool
from experts_store._manifest import ExpertEntry, Manifest
from experts_store._model import ExpertMLP
from experts_store._store import Store, StoreExpertLoader, StoreProblem
from experts_store._writer import StoreWriter

__all__ = [
    "FORMAT_VERSION",
    "CacheBusy",
    "CacheError",
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
    "ExpertTooLarge",
    "HostBufferPool",
    "Lease",
    "Manifest",
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
    "paper_parameter_count",
    "save_expert",
]
