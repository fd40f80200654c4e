"""The one owner of Ray in a momlp process: start (or join) it, and stop it only if started here.

`momlp serve`, `momlp demo` and the test suite all go through `ray_session`, so a process that
joined someone else's cluster never shuts it down, and one that started an embedded Ray
always does.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ray_session", "start_ray", "stop_ray"]

logger = logging.getLogger(__name__)

# Ray maps 127.0.0.1 to the machine's outward address unless this says it runs on one machine,
# and reads it once, when `ray` is first imported.
_ONE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_ray(*, address: str | None = None, num_cpus: int | None = None) -> bool:
    """Start an embedded Ray, or join `address`; False (and nothing done) if Ray is up."""
    if not address:
        # Before the import, at run time (never at module import), so that an embedded Ray
        # talks over loopback only; `momlp` sets it first thing too.
        os.environ.setdefault(_ONE_MACHINE, "0")
    import ray

    if ray.is_initialized():
        return False
    if address:
        logger.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, configure_logging=False, log_to_driver=False)
        return True
    logger.info("starting an embedded Ray")
    # address="local": a bare ray.init() would attach to any cluster `ray start` left behind.
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )
    except BaseException:
        # ray.init answers a SIGTERM with SystemExit from wherever it is; what of the node is
        # already up goes down now, though Ray does not count itself initialised yet. Its
        # node agents may still outlive this process by a minute (RESULTS.md, "Forty-ninth
        # session").
        with contextlib.suppress(Exception):
            ray.shutdown()
        raise
    node = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    if not _is_loopback(node):
        logger.warning(
            "the embedded Ray listens on %s, not on loopback (ray was imported before momlp "
            "started it, or %s is not 0); set %s=0 before ray is imported to keep it local",
            node, _ONE_MACHINE, _ONE_MACHINE,
        )
    return True


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return host == "localhost"


def stop_ray() -> None:
    """Shut Ray down (its driver connection; an embedded cluster with it)."""
    import ray

    if ray.is_initialized():
        started = time.monotonic()
        ray.shutdown()
        logger.info("Ray shut down in %.1f s", time.monotonic() - started)


@contextmanager
def ray_session(*, address: str | None = None, num_cpus: int | None = None) -> Iterator[bool]:
    """Ray for the `with` block: yields True if this call started (or joined) it, and then
    shuts it down on the way out; a Ray that was already up is left alone."""
    started = start_ray(address=address, num_cpus=num_cpus)
    try:
        yield started
    finally:
        if started:
            stop_ray()
