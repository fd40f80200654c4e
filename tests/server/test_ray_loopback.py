"""An embedded Ray started by momlp's own code stays on loopback, also for a program that
uses the library rather than the `momlp` command (which sets Ray's one-machine switch first
thing). Ray reads that switch when `ray` is first imported, so each case runs in a fresh
interpreter without it."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

_STARTS = {
    "server": "from server.pool import ray_session as up\nsession = up(num_cpus=1)",
    "trainer": "from trainer._executors import ray_runtime\nsession = ray_runtime(None, 1)",
}


def _node_ip(start: str, *, import_ray_first: bool = False) -> tuple[str, str]:
    """The node address of an embedded Ray that `start` brings up, and the process's stderr."""
    script = "\n".join([
        "import json, logging",
        "logging.basicConfig(level=logging.WARNING)",
        "import ray" if import_ray_first else "",
        start,
        "with session:",
        "    import ray",
        "    print(json.dumps(ray.util.get_node_ip_address()))",
    ])
    env = {k: v for k, v in os.environ.items() if k != _SWITCH and k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("owner", sorted(_STARTS))
def test_an_embedded_ray_listens_on_loopback_without_the_switch_set(owner: str) -> None:
    node, _ = _node_ip(_STARTS[owner])
    assert ipaddress.ip_address(node).is_loopback, node


def test_a_ray_imported_before_momlp_starts_it_is_named_in_a_warning() -> None:
    """The case the switch cannot reach: what happens on a machine with an outward address
    (this one, and CI's) when ray was imported first, without the switch."""
    node, stderr = _node_ip(_STARTS["server"], import_ray_first=True)
    if ipaddress.ip_address(node).is_loopback:
        pytest.skip("this machine has no outward address: Ray falls back to loopback anyway")
    assert f"the embedded Ray listens on {node}, not on loopback" in stderr
    assert f"set {_SWITCH}=0 before ray is imported" in stderr
