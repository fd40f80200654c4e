"""The loader behind an actor's expert cache: files read straight onto the actor's device,
hypernetworks verified and pinned, θ generated from a pinned f."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Protocol

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

__all__ = [
    "Cached", "CopyStream", "CudaCopyStream", "DeviceLoader", "load_error", "store_relative",
    "without_root",
]


# What an actor's cache holds: loaded experts, generated θ (also FrozenExperts) and pinned
# hypernetworks.
Cached = FrozenExpert | FrozenHyperNetwork


class CopyStream(Protocol):
    """The stream a CUDA actor's file loads copy on (`CudaCopyStream`; a fake in tests)."""

    def using(self) -> AbstractContextManager[object]:
        """Make it the calling thread's current stream for the `with` block."""
        ...

    def synchronize(self) -> None:
        """Wait until everything enqueued on it has run."""
        ...


class CudaCopyStream:
    """A side stream of one CUDA device."""

    def __init__(self, device: str) -> None:
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def using(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self._stream)

    def synchronize(self) -> None:
        self._stream.synchronize()


class DeviceLoader:
    """`ExpertLoader` that reads an `ExpertRef`'s file straight onto this actor's device.

    Two more kinds of key, told apart by type (files keep the path below unchanged): a
    `GeneratorRef` loads a hypernetwork f (verified against its sha256), a `GeneratedRef`
    generates θ_I with the f its actor pinned beforehand (`generators`).
    `copy_stream`: where file loads copy and pad (default: a side stream on CUDA, none on CPU).
    """

    def __init__(
        self, device: str, host_cache_bytes: int = 0, *, copy_stream: CopyStream | None = None
    ) -> None:
        self._device = device
        self.generators: dict[str, FrozenHyperNetwork] = {}
        tier = HostTier(host_cache_bytes) if host_cache_bytes > 0 else None
        self._files = ExpertRefLoader(device, host_tier=tier)
        # A side stream lets a host->device copy overlap another expert's forward on the
        # default stream (unmeasured on the CPU-only dev machine).
        if copy_stream is None and device.startswith("cuda"):
            copy_stream = CudaCopyStream(device)
        self._copy_stream = copy_stream

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
        return self._load_file(ref)

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
        stream = self._copy_stream
        if stream is None:
            return self._files.load(ref).aligned()
        # The load reads the file into pinned memory and copies it non-blocking on the
        # current stream, then waits for that stream: here the side stream, so only this
        # loader thread waits while the default stream keeps computing.
        with stream.using():
            loaded = self._files.load(ref)
            # Padded here and waited for too. The loaded tensors' blocks belong to the side
            # stream: once the unpadded expert is dropped the allocator hands them to that
            # stream's next allocation at once, ordered after its own work only. Padded on
            # the default stream, behind another expert's forward, the next load's copy could
            # land in them before the padding read them: this expert would then serve the
            # next one's weights.
            expert = loaded.aligned()
            if expert is not loaded:
                stream.synchronize()
        return expert


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
