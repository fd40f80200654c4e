"""Session-wide fixtures: one embedded Ray runtime for every test that needs it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Keep torch and BLAS from oversubscribing the 2-core machine inside Ray workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray maps 127.0.0.1 to the machine's outward address unless told this is a one-machine
# setup; with it, all of Ray's own traffic in tests stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# With both cores of a 2-core machine busy, a new actor took over the default minute to come
# up (a stress run; likely its worker's torch import). Tests allow three.
os.environ.setdefault("MOMLP_ACTOR_START_TIMEOUT_S", "180")


# The deployment's shape, not a roomier one: two CPUs, so two pool actors take every CPU
# of the cluster, as one actor per GPU takes every GPU of a GPU node.
RAY_TEST_CPUS = 2


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """Start Ray once per test session (about 5 s) through the server's one owner of Ray,
    and shut it down at the end."""
    from server.pool import ray_session as owned_ray

    with owned_ray(num_cpus=RAY_TEST_CPUS):
        yield
