"""The systems the serving benchmarks compare, one round each: `momlp serve` (a subprocess),
Ray Serve model multiplexing (in this process's Ray) and the in-process limit; with the
flags of the Ray Serve peer."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import torch
from _serve_driver import Record, frozen_heap, run_driver

from experts_store import Store
from router import PrototypeTree

__all__ = [
    "MOMLP_ENV",
    "RAYSERVE_BEST",
    "add_rayserve_args",
    "add_rayserve_proxy_arg",
    "free_port",
    "momlp_command",
    "peer_max_ongoing",
    "run_inprocess",
    "run_momlp",
    "run_rayserve",
    "served",
    "wait_ready",
]

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(
    url: str,
    probe: dict[str, Any],
    timeout_s: float,
    server: subprocess.Popen[bytes] | None = None,
) -> None:
    """Until `probe` is answered 200; refused at once if `server` (its process) has exited."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        try:
            response = httpx.post(url, json=probe, timeout=10.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout_s} s: {last}")


def momlp_command(args: argparse.Namespace, store: Store, port: int) -> list[str]:
    """`momlp serve` of `store` on 127.0.0.1:`port` with the benchmark's actors and budget."""
    return [
        str(Path(sys.executable).parent / "momlp"),
        "serve",
        "--store", str(store.root),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--device", "cpu",
        "--actors", str(args.actors),
        "--cache-bytes", str(args.budget),
        "--ray-num-cpus", str(args.ray_num_cpus),
        "--no-watch-store",
    ]  # fmt: skip


MOMLP_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}


def run_momlp(
    args: argparse.Namespace,
    store: Store,
    work: list[Any],
    round_: int,
    *,
    code: Path | None = None,
) -> Any:
    """One round against `momlp serve`; `code`: a checkout whose momlp the server and its
    actors run instead of this one (see `serve_ab.py --code`)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/predict"
    env = dict(os.environ, **MOMLP_ENV)
    if code is not None:
        # PYTHONPATH for the server; and Ray puts the server's working directory first on its
        # workers' sys.path, so the actors import the checkout's code only when started there.
        env["PYTHONPATH"] = os.fspath(code)
    command = momlp_command(args, store, port)
    with served(command, env, url, {"inputs": work[0][1]}, "momlp-serve-", cwd=code) as pid:
        return run_driver(url, work, args.warmup, args.concurrency, "momlp", pid, args.client)


@contextmanager
def served(
    command: list[str],
    env: dict[str, str],
    url: str,
    probe: dict[str, Any],
    prefix: str,
    cwd: Path | None = None,
) -> Iterator[int]:
    """A server process started from `command`, ready at `url`; yields its pid and stops it
    with SIGTERM. Its output goes to a temporary log, printed to stderr if anything fails or
    this process is interrupted (a caller's timeout sends SIGINT), so it says where it was."""
    with tempfile.NamedTemporaryFile("w+", prefix=prefix, suffix=".log") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
        try:
            wait_ready(url, probe, 240.0, process)
            yield process.pid
        except BaseException:
            _write_tail(log)
            raise
        finally:
            try:
                _stop(process)
            except BaseException:
                _write_tail(log)
                raise


def _write_tail(log: IO[str]) -> None:
    log.seek(0)
    sys.stderr.write(log.read()[-4000:])


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL past 90 s or when interrupted while waiting: never left behind."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=90)
    except BaseException as exc:
        process.kill()
        process.wait(timeout=30)
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise


RAYSERVE_BEST = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def run_inprocess(args: argparse.Namespace, store: Store, work: list[Any], round_: int) -> Any:
    """The limit: route, cache and forward each request in this thread, no HTTP, no Ray."""
    from experts_store import ExpertCache, ExpertRefLoader

    tree = PrototypeTree.load(store.router_path)
    refs = [store.expert_ref(e.id) for e in store.manifest.experts]
    cache: ExpertCache[Any] = ExpertCache(
        args.actors * args.budget, ExpertRefLoader("cpu"), policy="tinylfu"
    )
    mode = store.manifest.routing
    records: list[Record] = []
    measured_from, cpu_from = 0.0, 0.0
    with frozen_heap():
        for index, (_expert_id, rows) in enumerate(work):
            if index == args.warmup:
                measured_from, cpu_from = time.perf_counter(), time.process_time()
            start = time.perf_counter()
            x = torch.tensor(rows, dtype=torch.float32)
            experts = tree.route(x, mode=mode).experts[:, 0]
            hits = misses = 0
            if x.shape[0] == 1:
                # One row, one expert: no grouping (it would cost the limit ~10 % per row).
                with cache.lease(refs[int(experts[0])]) as lease, torch.inference_mode():
                    out = lease.value(x)
                hits, misses = int(lease.hit), int(not lease.hit)
            else:
                out = torch.empty(x.shape[0], store.manifest.output_dim)
                for expert in torch.unique(experts).tolist():
                    mask = experts == expert
                    with cache.lease(refs[expert]) as lease, torch.inference_mode():
                        out[mask] = lease.value(x[mask])
                    hits, misses = hits + int(lease.hit), misses + int(not lease.hit)
            latency = time.perf_counter() - start
            keep = out.tolist() if index < 32 else None
            records.append(Record(latency, True, hits, misses, {}, keep))
        cpu = {"serving": time.process_time() - cpu_from, "client": 0.0}
        seconds = time.perf_counter() - measured_from
    return records, seconds, cpu


def run_rayserve(args: argparse.Namespace, store: Store, work: list[Any], round_: int) -> Any:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if args.rayserve_config == "best":
        # Read by Serve's controller and proxy processes, which inherit this environment (and
        # by this process's ray.serve once, at import: set the same for every run in it).
        os.environ.update(RAYSERVE_BEST)
        if args.rayserve_proxy == "python":
            os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    # Ray's workers import _rayserve_app by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
    )
    import ray
    from ray import serve

    sys.path.insert(0, str(HERE))
    from _rayserve_app import build_app

    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/predict"
    ray.init(
        address="local",
        num_cpus=args.ray_num_cpus,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            store.root,
            replicas=args.actors,
            models_per_replica=args.experts_per_actor,
            mode=store.manifest.routing,
            max_ongoing_requests=peer_max_ongoing(args),
            batch_size=args.rayserve_batch,
            batch_wait_s=args.rayserve_batch_wait_ms / 1000.0,
        )
        serve.run(app, name="momlp_multiplexed", route_prefix="/v1/predict")
        wait_ready(url, {"inputs": work[0][1]}, 240.0)
        # Serve's processes descend from this one (ray.init started the cluster here).
        result = run_driver(
            url, work, args.warmup, args.concurrency, "ray_serve", os.getpid(), args.client
        )
    finally:
        # ray.shutdown() ends Serve's controller, proxy and replicas with the cluster; a
        # serve.shutdown() first only adds a noisy "graceful_shutdown failed" line on stdout.
        ray.shutdown()
    return result


def peer_max_ongoing(args: argparse.Namespace) -> int | None:
    """Ray Serve's max_ongoing_requests for this run (None: Ray's default of 5).

    Its performance guide says to raise it for `async` callables (the peer's is). At the
    concurrency each replica may take every request in flight; in `rayserve_configs.py` that
    gave 1.034-1.036x the rows/s of the default (medians of 3 and 6 rotated rounds; ahead in 6
    of the 9 rounds, within their spread) (benchmarks/RESULTS.md, "Forty-fifth session").
    """
    if args.rayserve_max_ongoing is not None:
        return args.rayserve_max_ongoing or None
    return args.concurrency if args.rayserve_config == "best" else None


def add_rayserve_proxy_arg(parser: argparse.ArgumentParser) -> None:
    """Which front receives the peer's requests (one per process: ray.serve reads it once)."""
    parser.add_argument(
        "--rayserve-proxy",
        choices=("haproxy", "python"),
        default="haproxy",
        help="with --rayserve-config best: HAProxy in front of the replicas (its documented "
        "high-throughput front) or Serve's Python proxy, which routes by multiplexed model",
    )


def add_rayserve_args(parser: argparse.ArgumentParser) -> None:
    """The peer's knobs: the two its performance guide names beside its throughput flags
    (max_ongoing_requests, @serve.batch), and which front receives the requests."""
    parser.add_argument(
        "--rayserve-max-ongoing",
        type=int,
        default=None,
        help="Ray Serve's max_ongoing_requests per replica; 0 keeps Ray's own (5); default: "
        "--concurrency with --rayserve-config best, else Ray's own",
    )
    add_rayserve_proxy_arg(parser)
    parser.add_argument(
        "--rayserve-batch",
        type=int,
        default=0,
        help="answer up to this many requests per replica call with @serve.batch (0: off)",
    )
    parser.add_argument(
        "--rayserve-batch-wait-ms",
        type=float,
        default=1.0,
        help="@serve.batch's batch_wait_timeout_s, in ms (with --rayserve-batch)",
    )
