"""Errors raised by router.

    RouterError
     ├── RouterInputError              a route() call the router refuses (HTTP 422 upstream)
     │    ├── DimensionMismatch(expected, got)
     │    ├── NonFiniteInput(rows)
     │    ├── InputOutOfRange(max_abs, limit)
     │    ├── EmptyBatch()
     │    ├── BadTopK(top_k, num_prototypes)
     │    ├── BadMode(mode)
     │    └── BadGate(field)           a gate setting out of its range (router.Gate)
     ├── RouterBuildError              prototypes PrototypeTree.build() refuses
     └── RouterFileError(path)         a router file that cannot be read or is inconsistent

Every error keeps its keyword fields as attributes (``exc.expected``) so the server maps
them without parsing messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "BadGate",
    "BadMode",
    "BadTopK",
    "DimensionMismatch",
    "EmptyBatch",
    "InputOutOfRange",
    "NonFiniteInput",
    "RouterBuildError",
    "RouterError",
    "RouterFileError",
    "RouterInputError",
]


class RouterError(Exception):
    """Base of every router error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword-only fields, so the default (cls, args) cannot rebuild one
        # where it is unpickled (a Ray task's error reached the driver as "Failed to
        # deserialize exception"): rebuilt from its args and fields as they are.
        return _rebuilt, (type(self), self.args, self.__dict__)


class RouterInputError(RouterError):
    """The inputs or options of a route() call are invalid; nothing was routed."""


class DimensionMismatch(RouterInputError):
    """Inputs are not a [B, n] batch of the router's dimension n."""

    def __init__(self, *, expected: int, got: tuple[int, ...]) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"inputs must have shape [B, {expected}], got {list(got)}")


class NonFiniteInput(RouterInputError):
    """Some inputs are NaN or infinite."""

    def __init__(self, *, rows: list[int]) -> None:
        self.rows = rows
        shown = ", ".join(str(r) for r in rows[:10]) + (", ..." if len(rows) > 10 else "")
        super().__init__(f"inputs contain NaN or infinite values (rows {shown})")


class InputOutOfRange(RouterInputError):
    """Inputs so large that squared distances would overflow; routing them would be a guess."""

    def __init__(self, *, max_abs: float, limit: float) -> None:
        self.max_abs = max_abs
        self.limit = limit
        super().__init__(f"input magnitude {max_abs:.3g} exceeds the routable limit {limit:.3g}")


class EmptyBatch(RouterInputError):
    """A batch with zero rows."""

    def __init__(self) -> None:
        super().__init__("inputs are empty (0 rows)")


class BadTopK(RouterInputError):
    """top_k is not an integer in 1..K."""

    def __init__(self, *, top_k: object, num_prototypes: int) -> None:
        self.top_k = top_k
        self.num_prototypes = num_prototypes
        super().__init__(f"top_k must be an integer in 1..{num_prototypes}, got {top_k!r}")


class BadMode(RouterInputError):
    """mode is neither "tree" nor "exact"."""

    def __init__(self, *, mode: object) -> None:
        self.mode = mode
        super().__init__(f'mode must be "tree" or "exact", got {mode!r}')


class BadGate(RouterInputError):
    """A `Gate` field out of its range (`field` names it)."""

    def __init__(self, *, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class RouterBuildError(RouterError):
    """The prototypes or build options cannot make a tree."""


class RouterFileError(RouterError):
    """A router file is missing, unreadable, or its arrays are inconsistent."""

    def __init__(self, *, path: Path | str, message: str) -> None:
        self.path = Path(path)
        super().__init__(f"bad router file {self.path}: {message}")


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc
