"""The two cache keys of a hyper store, which an actor's loader dispatches on.

`GeneratorRef` names f (a file, like an `ExpertRef`); `GeneratedRef` names θ_I (no file: the
actor generates it with the pinned f named by its `generator`). Both subclass `ExpertRef`, so
every seam that carries expert refs (groups, the pool, the dispatcher, the cache) carries them
unchanged; only the actor's loader looks at the type. Equality and hash stay the `sha256`
field: for a generated key it is `condition_key(...)`, never a file's hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from experts_store._hyper import HyperSpec
from experts_store._ref import ExpertRef

__all__ = ["GeneratedRef", "GeneratorRef", "condition_bytes", "condition_key"]


def condition_bytes(condition: np.ndarray | torch.Tensor | Sequence[float]) -> bytes:
    """A condition's canonical bytes: little-endian float32, -0.0 read as 0.0."""
    if isinstance(condition, torch.Tensor):
        condition = condition.detach().cpu().numpy()
    array = np.asarray(condition, dtype="<f4").reshape(-1) + np.float32(0.0)
    return array.astype("<f4").tobytes()


def condition_key(generator_sha256: str, condition: np.ndarray | torch.Tensor | bytes) -> str:
    """The cache key of θ_I: sha256 over f's content hash and I's float32 bytes, so the same
    condition under the same f is one cache entry, and a republished f is new keys."""
    raw = condition if isinstance(condition, bytes) else condition_bytes(condition)
    digest = hashlib.sha256(b"momlp-theta\0")
    digest.update(generator_sha256.encode("ascii"))
    digest.update(raw)
    return digest.hexdigest()


@dataclass(frozen=True)
class GeneratorRef(ExpertRef):
    """The hypernetwork file f: loaded once per actor and pinned there (never evicted)."""


@dataclass(frozen=True)
class GeneratedRef(ExpertRef):
    """θ_I for one condition I under `generator`; `sha256` is `condition_key(...)`, `path`
    the generator's file, `nbytes` |θ| as a cached expert."""

    generator: GeneratorRef = field(default=None, compare=False)  # type: ignore[assignment]
    condition: bytes = field(default=b"", compare=False)  # condition_bytes(I)
    spec_json: str = field(default="", compare=False)  # HyperSpec JSON: g's layout

    def condition_tensor(self) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(self.condition, dtype="<f4").copy())

    def spec(self) -> HyperSpec:
        return HyperSpec.model_validate_json(self.spec_json)
