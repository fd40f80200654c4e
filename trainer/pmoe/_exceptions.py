"""Errors of the patch-level MoE trainer; a branch of the trainer's tree.

    TrainerError                  (trainer._exceptions)
     └── PMoEError
          ├── PatchLayoutError    inputs whose shape does not match the model's patch layout
          └── PMoEConfigError     model or training options out of range or contradicting
"""

from __future__ import annotations

from .._exceptions import TrainerError

__all__ = ["PMoEConfigError", "PMoEError", "PatchLayoutError"]


class PMoEError(TrainerError):
    """Base of every error `trainer.pmoe` raises on purpose."""


class PatchLayoutError(PMoEError):
    """An input batch is not [B, n, d] (or [B, n*d]) for the model's n and d."""

    def __init__(self, *, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
        super().__init__(
            f"expected inputs of shape [B, {', '.join(map(str, expected))}], got {list(got)}",
            expected=expected,
            got=got,
        )
        self.expected = expected
        self.got = got


class PMoEConfigError(PMoEError):
    """An option is out of range; `option` names it (a config field), `reason` says why."""

    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(f"{option}: {message}", option=option, reason=message)
        self.option = option
        self.reason = message
