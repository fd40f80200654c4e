"""deploy/kuberay's head pod: its probes reach the server when an API key is set, the server
joins the Ray head beside it, waits for its actors, and stops before the Ray head does.
(No Kubernetes here: the manifest is read, and its shell commands run with stand-ins.)"""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import yaml  # Ray's own dependency

from server._cli import build_parser
from server._serve_cli import settings_from_args
from server.http._auth import OPEN_PATHS

pytestmark = pytest.mark.unit

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "raycluster.yaml"


def _head_pod() -> dict[str, Any]:
    [cluster] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayCluster"]
    pod: dict[str, Any] = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    return pod


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [container] = [c for c in pod["containers"] if c["name"] == name]
    found: dict[str, Any] = container
    return found


def _momlp_argv(container: dict[str, Any]) -> list[str]:
    """What `momlp` is called with: the command after `momlp`, or a `bash -c` script's
    `exec momlp serve "$@"` with the container's args."""
    command, args = container["command"], container.get("args", [])
    if command[0] == "momlp":
        return [*command[1:], *args]
    assert command[:2] == ["bash", "-c"], command
    assert command[2].rstrip().endswith('exec momlp serve "$@"'), command[2]
    return ["serve", *args]


def _serve_settings(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings `momlp serve` runs with in `container` (its args and literal env)."""
    for name in [n for n in os.environ if n.startswith("MOMLP_")]:
        monkeypatch.delenv(name)
    for env in container.get("env", []):
        if "value" in env:
            monkeypatch.setenv(env["name"], env["value"])
    return settings_from_args(build_parser().parse_args(_momlp_argv(container)))


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "containers" in node:
            yield from node["containers"]
        for value in node.values():
            yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def test_every_http_probe_of_a_keyed_container_is_an_open_path() -> None:
    # A probe's headers are literal text in the pod spec: it cannot send the key from the
    # secret, so a guarded probe path would keep the pod from ever being Ready.
    probes = []
    for document in yaml.safe_load_all(MANIFEST.read_text()):
        for container in _containers(document):
            keyed = any(env.get("name") == "MOMLP_API_KEY" for env in container.get("env", []))
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                get = container.get(kind, {}).get("httpGet")
                if keyed and get is not None:
                    probes.append(get["path"])
    assert {"/readyz", "/healthz"} <= set(probes)
    assert set(probes) <= OPEN_PATHS


def test_the_serving_sidecar_shares_the_ray_heads_session_folder_and_shared_memory() -> None:
    # A Ray driver in another container reaches the node's raylet through Unix sockets in
    # /tmp/ray/session_*/sockets and its object store through /dev/shm: without both shared,
    # `momlp serve --ray-address 127.0.0.1:6379` aborted at ray.init.
    [cluster] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayCluster"]
    pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {
        c["name"]: {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        for c in pod["containers"]
    }
    for path in ("/tmp/ray", "/dev/shm"):
        assert mounts["momlp-serve"][path] == mounts["ray-head"][path]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["ray-head"]["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}


def test_the_image_pins_the_ray_the_raycluster_declares() -> None:
    # Every node of a Ray cluster must run one Ray version; the image's pip install must not
    # pick a newer one than the RayCluster's rayVersion.
    declared = yaml.safe_load(MANIFEST.read_text())["spec"]["rayVersion"]
    dockerfile = (MANIFEST.parents[1] / "Dockerfile").read_text()
    assert f'ARG RAY_SPEC="ray[default]=={declared}"' in dockerfile
    assert 'pip install "$RAY_SPEC" .' in dockerfile
    # KubeRay's probes of the Ray containers run wget inside the image.
    assert "wget" in dockerfile.split("apt-get install", 1)[1].split("\n", 1)[0]


def test_the_server_leaves_the_service_before_it_stops_accepting() -> None:
    # Two requests sent at SIGTERM got network errors: momlp closes its port at once.
    [cluster] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayCluster"]
    pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    [serve] = [c for c in pod["containers"] if c["name"] == "momlp-serve"]
    command = serve["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and 0 < float(command[1]) < pod.get(
        "terminationGracePeriodSeconds", 30
    )


def test_the_server_waits_for_a_gpu_actor_on_each_gpu_its_workers_bring() -> None:
    # It starts before the GPU workers join: with `--device auto` it counted no GPU and served
    # on the head's CPU for its whole life, and the default 60 s start wait could end first.
    from server.pool import actor_count

    [cluster] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayCluster"]
    serve = _container(cluster["spec"]["headGroupSpec"]["template"]["spec"], "momlp-serve")
    settings = settings_from_args(build_parser().parse_args(_momlp_argv(serve)))
    gpus = sum(
        group["replicas"]
        * group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        for group in cluster["spec"]["workerGroupSpecs"]
    )
    assert settings.device == "cuda" and actor_count("cuda", settings, 0) == gpus
    env = {e["name"]: e.get("value") for e in serve["env"]}
    assert float(env["MOMLP_ACTOR_START_TIMEOUT_S"]) >= 600
    for group in cluster["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        shm = [m["name"] for m in pod["containers"][0]["volumeMounts"]
               if m["mountPath"] == "/dev/shm"]
        assert shm and {v["name"]: v for v in pod["volumes"]}[shm[0]]["emptyDir"] == {
            "medium": "Memory"}


def test_the_startup_probe_waits_as_long_as_the_server_waits_for_its_actors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # uvicorn binds the port only after the lifespan, which waits for the actors: a probe
    # that gave up at 300 s had the container killed and restarted while the GPU workers
    # pulled their image, however long MOMLP_ACTOR_START_TIMEOUT_S allowed.
    serve = _container(_head_pod(), "momlp-serve")
    settings = _serve_settings(serve, monkeypatch)
    probe = serve["startupProbe"]
    window = probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get(
        "failureThreshold", 3
    )
    # Beyond the actors: ray.init's own wait for the node (60 s) and opening the store.
    assert window >= settings.actor_start_timeout_s + 120


def test_the_pod_is_killed_only_after_requests_in_flight_could_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After its preStop, the server answers on through MOMLP_DRAIN_S, then lets each request
    # in flight run up to MOMLP_REQUEST_TIMEOUT_S (uvicorn's graceful shutdown), then closes
    # its actors and Ray; the default 30 s grace period killed it in the middle.
    pod = _head_pod()
    serve = _container(pod, "momlp-serve")
    settings = _serve_settings(serve, monkeypatch)
    [_, pause] = serve["lifecycle"]["preStop"]["exec"]["command"]
    needed = float(pause) + settings.drain_s + math.ceil(settings.request_timeout_s)
    assert pod.get("terminationGracePeriodSeconds", 30) >= needed + 10


class _ServingContainer:
    """The momlp-serve container's command, run here: the pod's shared /tmp/ray is
    `shared`, the Ray head's port is `port`, and `momlp` and `sleep` are stand-ins that
    report on `events` (`sleep` then waits for `go`; `momlp` runs until stdin closes)."""

    def __init__(self, tmp_path: Path, port: int) -> None:
        self.shared = tmp_path / "ray"
        self.shared.mkdir()
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        self.go = tmp_path / "go"
        os.mkfifo(self.go)
        read_end, write_end = os.pipe()
        stand_ins = {
            "momlp": 'echo "momlp $*" >&"$EVENTS_FD"\nread -r _ || true\n',
            "sleep": f'echo sleep >&"$EVENTS_FD"\nread -r _ <{self.go}\n',
        }
        for name, body in stand_ins.items():
            (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
            (bin_dir / name).chmod(0o755)
        serve = _container(_head_pod(), "momlp-serve")
        argv = [self.here(word, port) for word in [*serve["command"], *serve.get("args", [])]]
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
               "EVENTS_FD": str(write_end)}
        self.process = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                        pass_fds=(write_end,))
        os.close(write_end)
        self.events: IO[str] = os.fdopen(read_end)

    def here(self, text: str, port: int) -> str:
        return text.replace("/tmp/ray/", f"{self.shared}/").replace(
            "/127.0.0.1/6379", f"/127.0.0.1/{port}")

    def next_event(self) -> str:
        return self.events.readline().strip()

    def let_sleep_return(self) -> None:
        with open(self.go, "w") as go:
            go.write("\n")

    def stop(self) -> None:
        """Ends the stand-in `momlp` as a server's exit would, and waits for it."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)

    def close(self) -> None:
        try:  # a stand-in `sleep` still waiting would outlive the test
            go = os.open(self.go, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no one waits (ENXIO)
            pass
        else:
            os.write(go, b"\n")
            os.close(go)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.events.close()


@pytest.fixture
def head_port() -> Iterator[socket.socket]:
    """A port on loopback that refuses connections until the test calls `listen()`."""
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        yield head


def test_the_server_is_started_only_once_the_ray_head_accepts_connections(
    tmp_path: Path, head_port: socket.socket
) -> None:
    # The two containers start together; `momlp serve` gives up on a Ray address where
    # nothing answers within --ray-connect-wait-s (exit 1), which costs a restart and its
    # back-off when the head takes longer (pulling its image).
    container = _ServingContainer(tmp_path, head_port.getsockname()[1])
    try:
        assert container.next_event() == "sleep"  # the head refused: it waits, momlp not run
        head_port.listen()
        container.let_sleep_return()
        assert container.next_event().startswith("momlp serve --store /store --ray-address")
    finally:
        container.close()


def test_the_ray_head_stops_only_after_the_server_has_exited(
    tmp_path: Path, head_port: socket.socket
) -> None:
    # Each container gets SIGTERM when its own preStop ends: the Ray head, with none, stopped
    # while momlp still served (its 5 s pause, then its requests in flight), and the actors
    # went with it. Its preStop looks for the server's process, which it can see only in a
    # pod that shares one process namespace.
    pod = _head_pod()
    assert pod.get("shareProcessNamespace") is True
    head_port.listen()
    container = _ServingContainer(tmp_path, head_port.getsockname()[1])
    [bash, flag, script] = _container(pod, "ray-head")["lifecycle"]["preStop"]["exec"]["command"]
    loop = re.fullmatch(r"while (.+); do sleep 1; done", script)
    assert (bash, flag) == ("bash", "-c") and loop is not None, script
    still_serving = [bash, flag, container.here(loop.group(1), 0)]
    try:
        assert container.next_event().startswith("momlp serve")
        assert subprocess.run(still_serving, check=False, timeout=30).returncode == 0
        container.stop()
        assert subprocess.run(still_serving, check=False, timeout=30).returncode != 0
        done = subprocess.run([bash, flag, container.here(script, 0)], check=False, timeout=30)
        assert done.returncode == 0
    finally:
        container.close()
