"""Errors of the hypernetwork trainer; a branch of the trainer's tree.

    TrainerError                  (trainer._exceptions)
     └── HyperError
          ├── ThetaLayoutError    tensors or flat vectors that do not match a primary's layout
          └── HyperConfigError    model, data or training options out of range
"""

from __future__ import annotations

from .._exceptions import TrainerError

__all__ = ["HyperConfigError", "HyperError", "ThetaLayoutError"]


class HyperError(TrainerError):
    """Base of every error `trainer.hyper` raises on purpose."""


class ThetaLayoutError(HyperError):
    """A weight tensor, a flat weight vector or an input has the wrong name or shape.

    `name` is the tensor (or `"flat"`, `"x"`, `"condition"`, `"index"`), `expected` and `got`
    its shapes.
    """

    def __init__(self, *, name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
        super().__init__(
            f"{name}: expected shape {list(expected)}, got {list(got)}",
            name=name,
            expected=expected,
            got=got,
        )
        self.name = name
        self.expected = expected
        self.got = got


class HyperConfigError(HyperError):
    """An option is out of range; `option` names it."""

    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(f"{option}: {message}", option=option)
        self.option = option
