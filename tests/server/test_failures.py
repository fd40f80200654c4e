"""The pool's memory of expert files that failed to load forgets each one after its time: a
server meeting new bad files for weeks holds about those of the last `ttl_s`, not all."""

from __future__ import annotations

import pytest

from experts_store import ExpertRef
from server.pool._failures import LoadFailures

pytestmark = pytest.mark.unit


def bad_file(index: int) -> ExpertRef:
    return ExpertRef(f"{index:064x}", f"/store/experts/{index}-x.safetensors", 64, index)


def test_expired_failures_are_dropped_not_only_ignored() -> None:
    failures = LoadFailures(ttl_s=30.0)
    # One new bad file a second for almost three hours (republished stores, each broken).
    for second in range(10_000):
        failures.note(bad_file(second), "actor-0", "checksum mismatch", now=float(second))
    # About 30 are remembered now; the memory is within a small multiple of that.
    assert len(failures) <= 2 * 30 + 64


def test_a_failure_is_remembered_for_its_time_and_then_read_again() -> None:
    failures = LoadFailures(ttl_s=30.0)
    bad = bad_file(1)
    failures.note(bad, "actor-0", "checksum mismatch", now=100.0)
    # Many other files fail meanwhile, and their expired entries are dropped around it.
    for second in range(200):
        failures.note(bad_file(1000 + second), "actor-0", "missing", now=100.0 + second / 10)
    assert failures.remembered(bad.sha256, now=129.0) == ("checksum mismatch", 1.0)
    assert failures.remembered(bad.sha256, now=130.0) is None
