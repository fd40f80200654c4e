"""Optional capabilities a kind may have beyond `ServedModel`, for the floors above to ask for.

The HTTP floor checks for them with isinstance (these Protocols are runtime checkable), so a
kind that has them gets image bodies and per-patch routing in responses without the HTTP
floor naming the kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["PatchChoice", "PatchInputs", "PatchRowRouting"]


@dataclass(frozen=True)
class PatchChoice:
    """The patches (indices 0..n-1, in the order the expert took them) one expert took for
    one row, and each one's gate."""

    expert_id: int
    patches: list[int]
    gates: list[float]


@runtime_checkable
class PatchRowRouting(Protocol):
    """A row routing that knows, per row, which patches went to which expert."""

    @property
    def dense_patches(self) -> int:
        """Patch computations a dense mixture would make for these rows: rows·n·k."""
        ...

    def patch_choices(self) -> list[list[PatchChoice]]:
        """Per row, per expert that took any patch (in expert-id order), its choice."""
        ...


@runtime_checkable
class PatchInputs(Protocol):
    """A model whose inputs are patches: rows of n·d values, or images it cuts itself."""

    @property
    def image_shape(self) -> tuple[int, int, int] | None:
        """(H, W, C) of the images it takes, or None when it takes only flat rows."""
        ...

    def image_rows(self, images: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """[B, H, W, C] images as flat rows [B, n·d], patches in the order it was trained on."""
        ...
