"""The loader behind an actor's expert cache: files read straight onto the actor's device,
hypernetworks verified and pinned, θ generated from a pinned f."""

from __future__ import annotations

import os
from typing import Any

import torch

from experts_store import (
    ExpertLoadError,
    ExpertRef,
    ExpertRefLoader,
    FrozenExpert,
    FrozenHyperNetwork,
    GeneratedRef,
    GeneratorRef,
    HostTier,
    own_file_problem,
)

__all__ = ["Cached", "DeviceLoader", "load_error", "store_relative", "without_root"]


# What an actor's cache holds: loaded experts, generated θ (also FrozenExperts) and pinned
# hypernetworks.
Cached = FrozenExpert | FrozenHyperNetwork


class DeviceLoader:
    """`ExpertLoader` that reads an `ExpertRef`'s file straight onto this actor's device.

    Two more kinds of key, told apart by type (files keep the path below unchanged): a
    `GeneratorRef` loads a hypernetwork f (verified against its sha256), a `GeneratedRef`
    generates θ_I with the f its actor pinned beforehand (`generators`).
    """

    def __init__(self, device: str, host_cache_bytes: int = 0) -> None:
        self._device = device
        self.generators: dict[str, FrozenHyperNetwork] = {}
        self._cuda = device.startswith("cuda")
        tier = HostTier(host_cache_bytes) if host_cache_bytes > 0 else None
        self._files = ExpertRefLoader(device, host_tier=tier)
        # A side stream lets a host->device copy overlap another expert's forward on the
        # default stream; only exists on CUDA (unmeasured on the CPU-only dev machine).
        self._copy_stream: Any = (
            torch.cuda.Stream(device=device) if self._cuda else None  # type: ignore[no-untyped-call]
        )

    def nbytes(self, ref: ExpertRef) -> int:
        return ref.nbytes

    def load(self, ref: ExpertRef) -> Cached:
        if isinstance(ref, GeneratorRef):
            return FrozenHyperNetwork.load(
                ref.path, self._device, expected_sha256=ref.sha256, expected_bytes=ref.file_bytes
            )
        # Every kind's experts are served with aligned widths (batch invariance; see
        # experts_store._frozen.ROW_ALIGN). The cache counts the ref's unpadded bytes.
        if isinstance(ref, GeneratedRef):
            return self._generate(ref).aligned()
        return self._load_file(ref).aligned()

    def _generate(self, ref: GeneratedRef) -> FrozenExpert:
        generator = self.generators.get(ref.generator.sha256)
        if generator is None:
            # The actor pins f before leasing its keys; only a pin released in between (a
            # third f pinned concurrently) lands here: read f for this one generation.
            generator = FrozenHyperNetwork.load(
                ref.generator.path,
                self._device,
                expected_sha256=ref.generator.sha256,
                expected_bytes=ref.generator.file_bytes,
            )
        expert = generator.expert(ref.condition_tensor(), ref.spec())
        if expert.nbytes() != ref.nbytes:
            raise ExpertLoadError(expert_id=ref.expert_id, message="θ size differs from its key's")
        return expert

    def _load_file(self, ref: ExpertRef) -> FrozenExpert:
        # FrozenExpert, not ExpertMLP: serving never trains, and building the nn.Module
        # skeleton would cost as much as reading a small expert's file.
        if not self._cuda:
            return self._files.load(ref)
        # The load reads the file into pinned memory and copies it non-blocking on the
        # current stream, then waits for that stream: here the side stream, so only this
        # loader thread waits while the default stream keeps computing.
        with torch.cuda.stream(self._copy_stream):
            return self._files.load(ref)


def load_error(ref: ExpertRef, exc: ExpertLoadError) -> str:
    """What a failed load tells the client: f's own failure named as the hypernetwork file
    (its loader stands in expert id -1), anything else as the error says, with each file
    named as the store names it (`experts/12-<hash>.safetensors`), not by the server's path
    to it: a client has no business with the server's directories (the actor's and the
    pool's logs name the full path)."""
    if isinstance(ref, GeneratedRef) and exc.expert_id == ref.generator.expert_id:
        text = own_file_problem(f"hypernetwork {os.path.basename(ref.generator.path)}", exc)
    else:
        text = str(exc)
    return store_relative(ref, text)


def store_relative(ref: ExpertRef, text: str) -> str:
    """`text` (an error a client will read) with the store's root cut from the paths it
    names."""
    where = os.path.dirname(ref.path)
    # f lies at the store's root; an expert file in its experts/ directory (the manifest
    # admits no other name for it).
    return without_root(text, where if isinstance(ref, GeneratedRef) else os.path.dirname(where))


def without_root(text: str, root: str) -> str:
    """`text` with `root` cut from the paths under it it names."""
    root = root.rstrip(os.sep)
    if not root:
        return text  # a path with no directory to hide (a ref built by hand)
    return text.replace(root + os.sep, "")
