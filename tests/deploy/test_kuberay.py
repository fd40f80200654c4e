"""deploy/kuberay's probes reach the server when its API key is set."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # Ray's own dependency

from server.http._auth import OPEN_PATHS

pytestmark = pytest.mark.unit

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "raycluster.yaml"


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
    from server._cli import build_parser
    from server._serve_cli import settings_from_args
    from server.pool import actor_count

    [cluster] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayCluster"]
    [serve] = [c for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
               if c["name"] == "momlp-serve"]
    settings = settings_from_args(build_parser().parse_args([*serve["command"][1:],
                                                             *serve["args"]]))
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
