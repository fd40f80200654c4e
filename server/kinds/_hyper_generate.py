"""Kind "hyper"'s θ generated in the server process, for POST /v1/generate: θ_I = f(I) as the
bytes of a store expert file, with the same f and the same one-condition forward the actors
use (`server.kinds._hyper`; the actors generate the θ they serve themselves).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from experts_store import (
    ExpertLoadError,
    FrozenHyperNetwork,
    GeneratorRef,
    HyperSpec,
    condition_key,
    own_file_problem,
    theta_file_bytes,
)
from server._exceptions import ExpertUnavailable, InvalidRequest
from server.pool import without_root

__all__ = ["GENERATOR_ID", "LocalGenerator"]

# Errors about f name this id: it is no expert of the store.
GENERATOR_ID = -1

logger = logging.getLogger(__name__)


class LocalGenerator:
    """f, read in this process on first use (verified as the actors verify it), and the θ
    files it generates."""

    def __init__(self, generator: GeneratorRef, spec: HyperSpec) -> None:
        self._generator = generator
        self._spec = spec
        self._net: FrozenHyperNetwork | None = None
        self._lock = threading.Lock()

    def generate_file(
        self, condition: np.ndarray, tmp_dir: Path | None = None
    ) -> tuple[str, bytes]:
        """θ for `condition` as the bytes of a store expert file: (its cache key, the bytes).
        ExpertUnavailable when f cannot be read; InvalidRequest when θ is not finite."""
        generator = self._generator
        with self._lock:
            if self._net is None:
                try:
                    self._net = FrozenHyperNetwork.load(
                        generator.path,
                        expected_sha256=generator.sha256,
                        expected_bytes=generator.file_bytes,
                    )
                except ExpertLoadError as exc:
                    raise self._unavailable(exc) from exc
            net = self._net
        tensor = torch.from_numpy(np.asarray(condition, dtype=np.float32).reshape(1, -1))
        flat = net.flat(tensor)[0]
        if not bool(torch.isfinite(flat).all()):
            raise InvalidRequest(
                "the θ generated for this condition is not finite (a condition far outside "
                "the store's range overflows float32)",
                field="condition",
            )
        with tempfile.TemporaryDirectory(prefix="momlp-theta-") as tmp:
            data = theta_file_bytes(flat, self._spec, Path(tmp_dir or tmp))
        return condition_key(generator.sha256, tensor[0]), data

    def _unavailable(self, exc: ExpertLoadError) -> ExpertUnavailable:
        """f unreadable, told as the actors tell it (server.pool's `load_error`): the file by
        the name the store gives it, not "expert -1" at the server's path (the log has it)."""
        path = self._generator.path
        logger.warning("the hypernetwork %s cannot be read: %s", path, exc)
        reason = own_file_problem(f"hypernetwork {os.path.basename(path)}", exc)
        # f lies at the store's root.
        return ExpertUnavailable(
            expert_id=GENERATOR_ID, reason=without_root(reason, os.path.dirname(path))
        )
