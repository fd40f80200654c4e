"""Multi-node serving over a head and two worker nodes (deploy/local-cluster.sh).

One actor lands on each worker node (Settings.actor_resource), experts live on their
rendezvous homes, and when a worker node is killed the service keeps answering: the dead
actor's experts move to the survivor and no request of a stream running through the kill is
lost or answered twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_support import LocalModel, build_store, serve_process

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "local-cluster.sh"
ACTORS = ("actor-0", "actor-1")


@dataclass
class Cluster:
    address: str
    env: dict[str, str]
    dir: Path

    def run(self, *args: str) -> str:
        done = subprocess.run(
            ["bash", str(SCRIPT), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def worker_sessions(self) -> dict[str, int]:
        """worker name -> the session id its processes share (recorded by the script)."""
        rows = (self.dir / "nodes").read_text().split("\n")
        return {
            name: int(sid)
            for name, sid in (row.split() for row in rows if row.strip())
            if name.startswith("worker-")
        }


def _ray_command() -> str:
    """The `ray` of this interpreter's environment; else the one on PATH (Ray installed with
    `pip --target`, as benchmarks/gpu_session.sh does on a GPU machine)."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else shutil.which("ray") or str(beside)


def _free_port() -> int:
    # The head takes the port and port + 1 (Ray client server); find two free ones.
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
            port = int(probe.getsockname()[1])
        if port >= 65000:
            continue
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.2", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if shutil.which("setsid") is None:
        pytest.skip("setsid (util-linux) is needed by deploy/local-cluster.sh")
    port = _free_port()
    # Short: Ray's Unix socket paths under the temp dir must stay below 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="mn", dir="/tmp"))
    env = {
        **os.environ,
        "MOMLP_CLUSTER_PORT": str(port),
        "MOMLP_CLUSTER_DIR": str(root),
        "RAY": _ray_command(),
        # A killed node is declared dead after ~2 s instead of the default ~30 s.
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_failure_threshold": "4",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    made = Cluster(f"127.0.0.2:{port}", env, root)
    try:
        made.run("start", "2")
        yield made
    finally:
        # Always this cluster's own `stop` (never `ray stop`, which kills every Ray).
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, timeout=120, check=False)
        shutil.rmtree(root, ignore_errors=True)


def _home(key: str, actors: list[str]) -> str:
    """Rendezvous (highest random weight) hashing of an expert's cache key (its file's
    sha256), computed here independently."""

    def score(actor: str) -> int:
        digest = hashlib.blake2b(f"{key}\x00{actor}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return max(sorted(actors), key=score)


def _actor_processes(session: int) -> int:
    """Expert actors running among the processes of one worker node's session."""
    count = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getsid(int(proc.name)) != session:
                continue
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        count += b"ExpertActor" in cmdline
    return count


@pytest.fixture
def served(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    store = build_store(tmp_path / "store")
    env = {
        **cluster.env,
        # The cluster keeps Ray's token auth on; its token is what `start` says to use.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(cluster.dir / "auth_token"),
        "MOMLP_ACTOR_RESOURCE": "momlp_worker",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    # Relative, as README's examples give it: the worker nodes' processes run in another
    # working directory, where `store` is not this store.
    assert store == tmp_path / "store"
    args = ["--store", "store", "--port", "0", "--actors", "2", "--ray-address",
            cluster.address, "--cache-bytes", "1MiB", "--no-watch-store"]
    with serve_process(args, env=env, cwd=tmp_path) as server:
        yield server.url, store


def test_two_worker_nodes_share_the_experts_and_survive_losing_one(
    cluster: Cluster, served: tuple[str, Path]
) -> None:
    url, store = served
    local = LocalModel.open(store)
    rng = np.random.default_rng(0)
    # Rows at the prototypes route (exact mode) to every expert.
    protos = local.prototypes.astype(np.float32)

    def sha(expert_id: int) -> str:
        key: str = local.manifest["experts"][expert_id]["sha256"]
        return key

    sessions = cluster.worker_sessions()
    assert sorted(sessions) == ["worker-1", "worker-2"]
    # One actor on each worker node.
    assert [_actor_processes(sessions[w]) for w in sorted(sessions)] == [1, 1]

    def check(answer: httpx.Response, x: np.ndarray) -> dict[int, str]:
        assert answer.status_code == 200, answer.text
        body = answer.json()
        experts = np.asarray(body["experts"])[:, 0]
        nearest, _ = local.nearest(x, 1)
        np.testing.assert_array_equal(experts, nearest[:, 0])
        expected = np.stack([local.expert(int(e), x[i : i + 1])[0] for i, e in enumerate(experts)])
        np.testing.assert_allclose(body["outputs"], expected, rtol=1e-5, atol=1e-6)
        return {s["expert_id"]: s["actor"] for s in body["stats"]["experts"]}

    with httpx.Client(base_url=url, timeout=60.0) as http:
        used: dict[int, str] = {}
        for _ in range(3):
            x = protos + rng.normal(scale=1e-3, size=protos.shape).astype(np.float32)
            answer = http.post(
                "/v1/predict", json={"inputs": x.tolist(), "mode": "exact", "return_stats": True}
            )
            used.update(check(answer, x))
        # Requests are spread over both actors, each expert on its rendezvous home.
        assert set(used.values()) == set(ACTORS)
        assert used == {e: _home(sha(e), list(ACTORS)) for e in used}
        info = http.get("/v1/experts").json()
        for expert in info["experts"]:
            assert expert["actors"] in ([], [_home(sha(expert["id"]), list(ACTORS))]), expert
        assert all(a["resident_bytes"] <= a["budget_bytes"] for a in info["actors"])

        # A stream of requests, two at a time, through a worker node's death.
        results: list[tuple[int, int, dict[int, str]]] = []
        peak: dict[str, int] = {}
        errors: list[BaseException] = []
        stop = threading.Event()
        sent = iter(range(10**6))
        lock = threading.Lock()

        def stream() -> None:
            with httpx.Client(base_url=url, timeout=60.0) as own:
                while not stop.is_set():
                    with lock:
                        seq = next(sent)
                    x = protos + np.random.default_rng(seq).normal(
                        scale=1e-3, size=protos.shape
                    ).astype(np.float32)
                    try:
                        answer = own.post(
                            "/v1/predict",
                            json={"inputs": x.tolist(), "mode": "exact", "return_stats": True},
                        )
                        actors = check(answer, x)
                    except BaseException as exc:  # reported below, with the request number
                        errors.append(exc)
                        return
                    with lock:
                        results.append((seq, answer.status_code, actors))
                        for actor, resident in answer.json()["stats"]["device_bytes"].items():
                            peak[actor] = max(peak.get(actor, 0), resident)

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(results) < 10 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        cluster.run("kill-worker", "1")
        killed_at = len(results)
        deadline = time.monotonic() + 60
        while len(results) < killed_at + 60 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        stop.set()
        for thread in threads:
            thread.join(timeout=90)
        assert not errors, errors
        issued = next(sent)  # numbers handed out, one per request sent
        seqs = sorted(seq for seq, _, _ in results)
        print(
            json.dumps(
                {
                    "scenario": "worker node killed (multi-node)",
                    "requests": issued,
                    "answered_after_kill": len(results) - killed_at,
                    "errors": sum(status != 200 for _, status, _ in results),
                    "lost": issued - len(set(seqs)),
                    "duplicated": len(seqs) - len(set(seqs)),
                    "peak_resident_bytes": peak,
                    "budget_bytes": 1 << 20,
                }
            )
        )
        assert max(peak.values()) <= 1 << 20
        # Every request sent got exactly one answer, and it was a 200.
        assert seqs == list(range(issued)), (len(seqs), issued)
        assert {status for _, status, _ in results} == {200}
        assert len(results) >= killed_at + 60

        # The survivor now holds every expert it served, the dead node's ones included.
        late = [actors for seq, _, actors in sorted(results)[-5:]]
        survivors = {actor for actors in late for actor in actors.values()}
        assert len(survivors) == 1, late
        survivor = survivors.pop()
        assert set(late[-1]) == set(range(len(protos)))
        info = http.get("/v1/experts").json()
        alive = {a["name"]: a["alive"] for a in info["actors"]}
        assert alive[survivor] is True
        resident = {e["id"]: e["actors"] for e in info["experts"]}
        assert all(resident[e] == [survivor] for e in range(len(protos))), resident
    # The surviving worker node still runs exactly its one actor.
    assert _actor_processes(sessions["worker-2"]) == 1
