"""Errors of `momlp build`; each names what went wrong in keyword fields.

    TrainerError
     ├── DataError            a dataset or data file that cannot be trained on (NaN, shapes, ...)
     ├── ConfigError          build options that contradict each other or are out of range
     └── BuildFailed          an expert's task (or the baseline's) failed after its retries,
                              or reading back what it wrote did (stage "evaluating")
"""

from __future__ import annotations

from typing import Any

__all__ = ["BuildFailed", "ConfigError", "DataError", "TrainerError"]


class TrainerError(Exception):
    """Base of every error the trainer raises on purpose."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword-only fields, so the default (cls, args) cannot rebuild one
        # where it is unpickled (a Ray task's error reached the driver as "Failed to
        # deserialize exception"): rebuilt from its args and fields as they are.
        return _rebuilt, (type(self), self.args, self.__dict__)


class DataError(TrainerError):
    """The data are refused before any training starts."""

    def __init__(self, message: str, *, source: str) -> None:
        super().__init__(f"{source}: {message}", source=source)
        self.source = source


class ConfigError(TrainerError):
    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(f"--{option.replace('_', '-')}: {message}", option=option)
        self.option = option


class BuildFailed(TrainerError):
    """A training task, or the evaluation of what it wrote (`stage`), failed for good; no
    store was published."""

    def __init__(
        self, *, expert_id: int | None, reason: str, stage: str = "training"
    ) -> None:
        what = "the baseline" if expert_id is None else f"expert {expert_id}"
        super().__init__(
            f"{stage} {what} failed: {reason}", expert_id=expert_id, reason=reason, stage=stage
        )
        self.expert_id = expert_id
        self.reason = reason
        self.stage = stage


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc
