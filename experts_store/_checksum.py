"""Checksums of expert files: the fast one checked on every load, and sha256.

A manifest row records two: ``sha256`` (names the file, checked by ``momlp store verify``)
and ``checksum``, written ``"<algo>:<hex>"``, today always ``"xxh3_128:..."``. sha256 runs at
about 1.9 GB/s on the development VM (with SHA extensions), 6-10x the cost of a load from the
page cache (about 15 GB/s for a 128 MiB expert); XXH3-128 runs at ~30 GB/s from memory and
~80 GB/s from L2, so hashing each chunk of the file right after it is read adds 15-25% to the
load (benchmarks/expert_load.py; figures in benchmarks/RESULTS.md, "fast checksum"). BLAKE3,
the fast cryptographic choice, runs at 6-10 GB/s on one core here: as slow as the copy.
The fast checksum guards against corruption (a flipped bit, a truncated or swapped file), not
against an adversary: whoever can rewrite an expert file can rewrite the manifest too.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any, Protocol

import xxhash

from experts_store._exceptions import ExpertChecksumError, ExpertFormatError

__all__ = [
    "FAST_CHECKSUM_ALGO",
    "Digest",
    "ExpectedDigest",
    "checksum_algo",
    "fast_checksum",
    "known_checksum",
    "new_fast_digest",
]

FAST_CHECKSUM_ALGO = "xxh3_128"
SHA256 = "sha256"
_CHECKSUM = re.compile(r"([a-z0-9_]+):([0-9a-f]+)")


class Digest(Protocol):
    """A running hash (hashlib's and xxhash's objects both are)."""

    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


_ALGOS: dict[str, Callable[[], Digest]] = {
    FAST_CHECKSUM_ALGO: xxhash.xxh3_128,
    SHA256: hashlib.sha256,
}


def new_fast_digest() -> Digest:
    """A running hash of the fast algorithm (what publishing records)."""
    digest: Digest = xxhash.xxh3_128()
    return digest


def fast_checksum(digest: Digest) -> str:
    """The manifest form ``"xxh3_128:<hex>"`` of a finished fast digest."""
    return f"{FAST_CHECKSUM_ALGO}:{digest.hexdigest()}"


def checksum_algo(value: str) -> str | None:
    """The algorithm named by a well-formed ``"<algo>:<hex>"`` value, else None."""
    match = _CHECKSUM.fullmatch(value)
    return match.group(1) if match else None


def known_checksum(value: str | None) -> bool:
    """Whether this reader can check ``value`` (a manifest's ``checksum`` field)."""
    return value is not None and checksum_algo(value) in _ALGOS


class ExpectedDigest:
    """A hash computed while a file is read, and the value it must end at.

    ``expected`` is a bare sha256 hex (``expected_sha256``) or an ``"<algo>:<hex>"``
    checksum; an unknown algorithm raises ExpertFormatError naming the expert.
    """

    def __init__(self, expected: str, *, expert_id: int | None, bare_sha256: bool = False) -> None:
        self.expected = expected
        self.expert_id = expert_id
        if bare_sha256:
            self._prefix = ""
            algo: str | None = SHA256
        else:
            algo = checksum_algo(expected)
            self._prefix = f"{algo}:"
        factory = _ALGOS.get(algo or "")
        if factory is None:
            raise ExpertFormatError(
                expert_id=expert_id,
                reason=f"checksum {expected[:40]!r} names no known algorithm "
                f"(known: {', '.join(sorted(_ALGOS))})",
            )
        self.digest: Digest = factory()

    def check(self) -> None:
        """Raise ExpertChecksumError naming the expert unless the bytes hashed match."""
        actual = self._prefix + self.digest.hexdigest()
        if actual != self.expected:
            raise ExpertChecksumError(
                expert_id=self.expert_id, expected=self.expected, actual=actual
            )
