"""Errors raised by experts_store.

    StoreError
     ├── StoreNotFound(root)
     ├── ManifestError(root)
     ├── StoreChanged(root, based_on, live)
     ├── StoreWriteError(path, reason, live)
     ├── UnknownExpert(expert_id)
     ├── ExpertLoadError(expert_id)
     │    ├── ExpertChecksumError(expert_id, expected, actual)
     │    ├── ExpertFileMissing(expert_id, path)
     │    └── ExpertFormatError(expert_id)
     └── CacheError
          ├── ExpertTooLarge(expert_id, nbytes, budget_bytes)
          └── CacheBusy(expert_id)

Every error keeps its keyword fields as attributes (``exc.expert_id``) so callers (the
server's error handler) map them without parsing messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "CacheBusy",
    "CacheError",
    "ExpertChecksumError",
    "ExpertFileMissing",
    "ExpertFormatError",
    "ExpertLoadError",
    "ExpertTooLarge",
    "ManifestError",
    "StoreChanged",
    "StoreError",
    "StoreNotFound",
    "StoreWriteError",
    "UnknownExpert",
]


def _expert_name(expert_id: int | None) -> str:
    return "expert" if expert_id is None else f"expert {expert_id}"


class StoreError(Exception):
    """Base of every experts_store error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword-only fields, so the default (cls, args) cannot rebuild one
        # where it is unpickled (a Ray task's error reached the driver as "Failed to
        # deserialize exception"): rebuilt from its args and fields as they are.
        return _rebuilt, (type(self), self.args, self.__dict__)


class StoreNotFound(StoreError):
    """The directory holds no published store (no manifest.json)."""

    def __init__(self, *, root: Path | str, message: str | None = None) -> None:
        self.root = Path(root)
        super().__init__(message or f"no store at {self.root} (manifest.json not found)")


class ManifestError(StoreError):
    """manifest.json exists but is unreadable or violates the store contract. `root`: the
    store it was read from; None for a manifest's bytes given by a caller (`read_manifest`)."""

    def __init__(self, *, root: Path | str | None, message: str) -> None:
        self.root = None if root is None else Path(root)
        where = "" if self.root is None else f" in {self.root}"
        super().__init__(f"bad manifest{where}: {message}")


class StoreChanged(StoreError):
    """Another version went live while a writer that derives from the version it started
    from was at work (`StoreWriter(based_on=...)`, e.g. `momlp store calibrate`): nothing
    was published, which would have undone the other one."""

    def __init__(self, *, root: Path | str, based_on: str, live: str | None) -> None:
        self.root = Path(root)
        self.based_on = based_on
        self.live = live
        super().__init__(
            f"the store at {self.root} changed while this ran: it started from version "
            f"{based_on}, and {'version ' + live if live else 'no version'} is live now; "
            "nothing was published (run it again on the live version)"
        )


class StoreWriteError(StoreError):
    """A file of a store could not be written (a full disk, a size limit, a read-only file
    system, permissions): nothing was published by the write that failed. `live`: the
    version still live, where the failure was a publish's."""

    def __init__(self, *, path: Path | str, reason: str, live: str | None = None) -> None:
        self.path = Path(path)
        self.reason = reason
        self.live = live
        still = f" (version {live} is still live)" if live else ""
        super().__init__(f"cannot write {self.path}: {reason}; nothing was published{still}")


    @classmethod
    def of(cls, exc: OSError, path: Path | str, live: str | None = None) -> StoreWriteError:
        """From the OSError of a write to `path` (its message may name another file)."""
        named = exc.filename is not None and str(exc.filename) != str(path)
        reason = str(exc) if named else (exc.strerror or str(exc))
        return cls(path=path, reason=reason, live=live)


class UnknownExpert(StoreError):
    """The expert id is not in the manifest."""

    def __init__(self, *, expert_id: int, num_experts: int | None = None) -> None:
        self.expert_id = expert_id
        self.num_experts = num_experts
        bound = "" if num_experts is None else f" (store has ids 0..{num_experts - 1})"
        super().__init__(f"unknown expert {expert_id}{bound}")


class ExpertLoadError(StoreError):
    """An expert's file cannot be turned into a module."""

    def __init__(self, *, expert_id: int | None, message: str) -> None:
        self.expert_id = expert_id
        super().__init__(message)


def _short_checksum(value: str) -> str:
    # "xxh3_128:<hex>" keeps its algorithm name; a bare hex is a sha256.
    algo, sep, digits = value.rpartition(":")
    return f"{algo} {digits[:16]}..." if sep else f"sha256 {value[:16]}..."


class ExpertChecksumError(ExpertLoadError):
    """The file's bytes hash differently from what the manifest records.

    ``expected``/``actual`` are bare sha256 hex digests, or ``"<algo>:<hex>"`` checksums.
    """

    def __init__(self, *, expert_id: int | None, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(
            expert_id=expert_id,
            message=(
                f"{_expert_name(expert_id)}: checksum mismatch "
                f"(manifest {_short_checksum(expected)}, file {_short_checksum(actual)})"
            ),
        )


class ExpertFileMissing(ExpertLoadError):
    """The file the manifest names does not exist."""

    def __init__(self, *, expert_id: int | None, path: Path | str) -> None:
        self.path = Path(path)
        super().__init__(
            expert_id=expert_id, message=f"{_expert_name(expert_id)}: file missing: {self.path}"
        )


class ExpertFormatError(ExpertLoadError):
    """The file is not a valid one-expert safetensors file (header, arch, dtype, shape)."""

    def __init__(self, *, expert_id: int | None, reason: str) -> None:
        self.reason = reason
        super().__init__(
            expert_id=expert_id, message=f"{_expert_name(expert_id)}: bad expert file: {reason}"
        )


class CacheError(StoreError):
    """Base of the ExpertCache errors."""


class ExpertTooLarge(CacheError):
    """The expert alone needs more bytes than the cache may ever hold."""

    def __init__(self, *, expert_id: int, nbytes: int, budget_bytes: int) -> None:
        self.expert_id = expert_id
        self.nbytes = nbytes
        self.budget_bytes = budget_bytes
        super().__init__(
            f"expert {expert_id} needs {nbytes} bytes, more than the cache budget "
            f"of {budget_bytes} bytes"
        )


class CacheBusy(CacheError):
    """No room could be made in time: every resident expert is leased."""

    def __init__(self, *, expert_id: int, timeout: float | None = None) -> None:
        self.expert_id = expert_id
        self.timeout = timeout
        within = "" if timeout is None else f" within {timeout:g} s"
        super().__init__(f"no room for expert {expert_id}{within}: every resident expert is in use")


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc
