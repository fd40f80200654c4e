"""deploy/local-cluster.sh's refusals, which need no Ray started: commands on a cluster that
is not there, a bad node count, a port in use, in Ray's worker port range or not a port at
all. (Starting and serving on it: tests/integration/test_multinode.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "local-cluster.sh"


def run(tmp_path: Path, *args: str, port: int | str = 6390) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOMLP_CLUSTER_DIR": str(tmp_path / "cluster"),
           "MOMLP_CLUSTER_PORT": str(port), "RAY": "/bin/false"}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=30, check=False)


@pytest.mark.parametrize("command", [["status"], ["add-worker"], ["kill-worker", "1"]])
def test_commands_on_a_cluster_not_started_say_so_at_once(
    tmp_path: Path, command: list[str]
) -> None:
    done = run(tmp_path, *command)
    assert done.returncode == 1
    assert f"no cluster is recorded in {tmp_path / 'cluster'}" in done.stderr
    assert "start N" in done.stderr


def test_stop_without_a_cluster_does_not_claim_to_have_stopped_one(tmp_path: Path) -> None:
    done = run(tmp_path, "stop")
    assert done.returncode == 0
    assert "nothing to stop" in done.stdout and "cluster stopped" not in done.stdout


@pytest.mark.parametrize("count", ["two", "0"])
def test_start_refuses_a_node_count_that_is_not_a_number(tmp_path: Path, count: str) -> None:
    # "0" started a head and printed a serve command with --actors 0, which serve refuses.
    done = run(tmp_path, "start", count)
    assert done.returncode == 2 and "whole number >= 1" in done.stderr
    assert not (tmp_path / "cluster" / "nodes").exists()


def test_start_names_a_port_in_use_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run(tmp_path, "start", "1", port=port)
    assert done.returncode == 1
    assert f"port {port} on 127.0.0.2 is in use" in done.stderr
    assert "MOMLP_CLUSTER_PORT" in done.stderr
    assert not (tmp_path / "cluster" / "nodes").exists()


@pytest.mark.parametrize("port", [10001, 10002, 15000, 19999])
def test_start_refuses_a_port_in_rays_worker_port_range_before_starting_anything(
    tmp_path: Path, port: int
) -> None:
    # The head takes the port and the next one; 10001 is refused for 10002.
    done = run(tmp_path, "start", "1", port=port)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert f"MOMLP_CLUSTER_PORT {port}" in done.stderr
    assert "worker port range 10002-19999" in done.stderr
    assert not (tmp_path / "cluster" / "nodes").exists()


@pytest.mark.parametrize("port", ["abc", "08", "0", "65535"])
def test_start_refuses_a_port_that_is_not_a_port_number(tmp_path: Path, port: str) -> None:
    done = run(tmp_path, "start", "1", port=port)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "MOMLP_CLUSTER_PORT must be a port number from 1 to 65534" in done.stderr
    assert f"got '{port}'" in done.stderr
    assert not (tmp_path / "cluster" / "nodes").exists()


def test_every_node_is_given_the_worker_port_range_the_check_uses(tmp_path: Path) -> None:
    # A stand-in for `ray` that records its arguments: nothing of Ray starts.
    calls = tmp_path / "calls"
    fake_ray = tmp_path / "ray"
    fake_ray.write_text(f'#!/usr/bin/env bash\necho "$*" >>{calls}\n')
    fake_ray.chmod(0o755)
    with socket.socket() as free:
        free.bind(("127.0.0.2", 0))
        port = free.getsockname()[1]  # an ephemeral port, above Ray's worker range
    env = {**os.environ, "MOMLP_CLUSTER_DIR": str(tmp_path / "cluster"),
           "MOMLP_CLUSTER_PORT": str(port), "RAY": str(fake_ray)}
    done = subprocess.run(["bash", str(SCRIPT), "start", "1"], env=env, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    head, worker = calls.read_text().splitlines()
    for call in (head, worker):
        assert "--min-worker-port=10002 --max-worker-port=19999" in call, call
    assert f"--port={port}" in head and "--head" in head
