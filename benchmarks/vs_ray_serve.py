"""momlp vs Ray Serve model multiplexing: same store, same actors, same bytes, same load.

Both systems serve one store of K random-weight PReLU experts (K >= 200; a serving benchmark
needs realistic sizes, not trained weights) on `--actors` CPU actors / replicas (1 CPU, 1
torch thread each) with room for `--experts-per-actor` experts each: momlp through
`momlp serve --cache-bytes B` (a subprocess, its own embedded Ray), the baseline through one
Ray Serve deployment whose replicas route the rows themselves and load experts through
`@serve.multiplexed(max_num_models_per_replica = B // expert bytes)` (benchmarks/_rayserve_app.py).

The same driver (`--client`: aiohttp by default, or httpx; closed loop, `--concurrency` requests
in flight) sends both the same seeded sequence of requests of `--rows-per-request` rows (default
1) whose experts follow Zipf(1.0) over the experts ranked by a seeded permutation; each row is
drawn near its expert's prototype and verified to route there. A Ray Serve HTTP request names
one multiplexed model (header `serve_multiplexed_model_id`), so the driver sends the first row's
expert in that header and Serve's Python proxy can prefer a replica that holds it (HAProxy, in
front with the high-throughput setting, balances by least connections instead); the replica
routes the rows and loads the other experts itself. momlp ignores the header and routes on
the server. Each round runs both systems one after the other (the order alternates), each from
a cold start; the first `--warmup` requests are not measured.

Ray Serve runs in its best documented configuration for throughput by default
(`--rayserve-config best`: `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` and `RAY_SERVE_ENABLE_HA_PROXY=1`,
both in Ray >= 2.55, set before its processes start, and `max_ongoing_requests` raised from 5
to `--concurrency`, as its performance guide advises for async callables);
`--rayserve-config default` runs its defaults. Its guide's other advice for throughput,
dynamic request batching (`--rayserve-batch`), made it slower on this workload, and Serve's
Python proxy in HAProxy's place (`--rayserve-proxy python`, which routes by multiplexed model)
made it about 3x slower (`rayserve_configs.py` compares the peer's configurations). A
comparison is only fair against the peer at its best.

Each round also runs the *in-process limit* of the same workload: the same router, cache policy
and total cache capacity, and forward, in one Python thread with no HTTP and no Ray. momlp's
ratio to it says how much of its own work's speed the serving stack delivers.

Each line also splits the CPU time of the measured requests per row into the serving side (a
system's processes: server or proxy, Ray, actors or replicas) and the client (this process):
once the benchmark saturates the machine's cores, CPU per row is what bounds rows/s.

Prints one JSON line per system and round, one per system with the medians over rounds, and
one with the ratios and the arithmetic behind the rows/s ratio (cores busy over CPU per row:
`ratio_arithmetic`). Binds and sends only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np
import torch

from experts_store import ExpertArch, ExpertMLP, Store, StoreWriter
from router import PrototypeTree

HERE = Path(__file__).resolve().parent
MACHINE = os.environ.get("MOMLP_BENCH_MACHINE", "2-core x86-64 VM, no GPU, shared with other work")


def cpu_facts() -> str:
    """The host's CPU model and cache sizes, as this VM reports them.

    The development VM has run on more than one kind of host, and the ratios moved with it
    (RESULTS.md, thirty-fourth session), so every record says which host it ran on.
    """
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            caches.append(f"L{level} {size}")
    return ", ".join([model, *caches])


# The issue-19 workload (its independent run): 200 experts of 0.55 MB, 20 per actor, 4-row
# requests; `add_workload_args(parser, store=..., **ISSUE_WORKLOAD)` makes it the default.
ISSUE_WORKLOAD: dict[str, Any] = {
    "experts": 200, "widths": "16,256,512,8", "experts_per_actor": 20, "rows_per_request": 4,
}  # fmt: skip


def build_store(root: Path, *, experts: int, widths: tuple[int, ...], seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    arch = ExpertArch(widths=widths)
    with StoreWriter(root) as writer:
        for expert_id in range(experts):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        prototypes = torch.randn(experts, widths[0], generator=generator)
        PrototypeTree.build(prototypes, branching=4, seed=seed).save(writer.router_path)
        writer.publish(
            task="regression",
            input_dim=widths[0],
            output_dim=widths[-1],
            routing="tree",
            branching=4,
            extra={"note": "random-weight experts for the vs_ray_serve benchmark"},
        )
    return root


def open_or_build(root: Path, *, experts: int, widths: tuple[int, ...], seed: int) -> Store:
    if (root / "manifest.json").exists():
        store = Store.open(root)
        entry = store.manifest.experts[0]
        if store.manifest.num_experts == experts and tuple(entry.arch["widths"]) == widths:
            return store
        raise SystemExit(f"{root} holds another store; pass a fresh --store")
    return Store.open(build_store(root, experts=experts, widths=widths, seed=seed))


def make_workload(
    store: Store, *, count: int, seed: int, rows_per_request: int = 1
) -> list[tuple[int, list[list[float]]]]:
    """`count` requests of `rows_per_request` rows, each row drawn as an (expert, row) pair:
    Zipf(1.0) over a seeded ranking of the experts, the row near the expert's prototype and
    verified (tree routing) to reach it. A request is (its first row's expert, its rows)."""
    tree = PrototypeTree.load(store.router_path)
    rng = np.random.default_rng(seed)
    k = tree.num_prototypes
    prototypes = tree.prototypes.numpy().astype(np.float32)
    pools: dict[int, list[np.ndarray]] = {e: [] for e in range(k)}
    for scale in (0.05, 0.01, 0.0):
        missing = [e for e in range(k) if len(pools[e]) < 4]
        if not missing:
            break
        base = np.repeat(prototypes[missing], 8, axis=0)
        candidates = base + scale * rng.standard_normal(base.shape).astype(np.float32)
        routed = tree.route(candidates, mode="tree").experts[:, 0].numpy()
        for row, expert_id in zip(candidates, routed, strict=True):
            pools[int(expert_id)].append(row)
    servable = [e for e in range(k) if pools[e]]
    ranking = rng.permutation(servable)
    weights = 1.0 / np.arange(1, len(ranking) + 1)
    draws = rng.choice(ranking, size=count * rows_per_request, p=weights / weights.sum())
    rows = [pools[int(e)][int(rng.integers(len(pools[int(e)])))].tolist() for e in draws]
    return [
        (int(draws[i]), rows[i : i + rows_per_request])
        for i in range(0, len(rows), rows_per_request)
    ]


class CpuMeter:
    """CPU seconds spent by the serving side (a process and all its descendants: Ray's
    raylet, GCS, workers and actors, Serve's proxy) and by this process (the load generator).

    On a machine whose cores the benchmark saturates, CPU per row is what sets the rows/s a
    system can reach, so each system's figure is split into its serving side and the client.
    A process that ends inside the window loses its CPU time from the count.
    """

    def __init__(self, serving_root: int) -> None:
        import psutil

        self._root = psutil.Process(serving_root)
        self._own = psutil.Process()
        self._start: tuple[dict[int, float], float] = self._sample()

    def _sample(self) -> tuple[dict[int, float], float]:
        import psutil

        serving: dict[int, float] = {}
        tree = self._root.children(recursive=True)
        if self._root.pid != self._own.pid:
            tree.append(self._root)
        for proc in tree:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            serving[proc.pid] = times.user + times.system
        own = self._own.cpu_times()
        return serving, own.user + own.system

    def restart(self) -> None:
        self._start = self._sample()

    def elapsed(self) -> dict[str, float]:
        """CPU seconds since construction or the last `restart()`: serving side, client."""
        split = self.elapsed_split()
        return {"serving": split["root"] + split["descendants"], "client": split["client"]}

    def elapsed_split(self) -> dict[str, float]:
        """`elapsed`, its serving side split into the root process and its descendants."""
        serving, own = self._sample()
        before, own_before = self._start
        spent = {pid: cpu - before.get(pid, 0.0) for pid, cpu in serving.items()}
        root = spent.pop(self._root.pid, 0.0)
        return {"root": root, "descendants": sum(spent.values()), "client": own - own_before}


@dataclass
class Record:
    latency_s: float
    ok: bool
    hits: int = 0
    misses: int = 0
    resident: dict[str, int] = field(default_factory=dict)
    outputs: list[list[float]] | None = None


def parse_momlp(body: dict[str, Any]) -> tuple[int, int, dict[str, int]]:
    stats = body["stats"]
    hits = sum(1 for s in stats["experts"] if s["cache"] == "hit")
    return hits, len(stats["experts"]) - hits, dict(stats["device_bytes"])


def parse_rayserve(body: dict[str, Any]) -> tuple[int, int, dict[str, int]]:
    return int(body["hits"]), int(body["misses"]), {body["replica"]: int(body["resident_bytes"])}


# One POST: (status, parsed JSON body or {}); raises the library's own errors.
Post = Callable[[str, dict[str, Any], dict[str, str]], Awaitable[tuple[int, dict[str, Any]]]]


@asynccontextmanager
async def http_client(kind: str, concurrency: int) -> AsyncIterator[Post]:
    """A pooled HTTP/1.1 keep-alive client with `concurrency` connections.

    httpx is pure Python above the socket and costs ~1.4 ms of CPU per request here;
    aiohttp parses in C and costs ~0.09 ms (RESULTS, "the load generator's own CPU"). On a
    machine whose cores the servers share with the load generator, the client's CPU is taken from
    the servers, so the cheaper client measures the servers more than itself.
    """
    if kind == "httpx":
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:

            async def post_httpx(
                url: str, body: dict[str, Any], headers: dict[str, str]
            ) -> tuple[int, dict[str, Any]]:
                response = await client.post(url, json=body, headers=headers)
                ok = response.status_code == 200
                return response.status_code, response.json() if ok else {}

            yield post_httpx
        return
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def post_aiohttp(
            url: str, body: dict[str, Any], headers: dict[str, str]
        ) -> tuple[int, dict[str, Any]]:
            async with session.post(url, json=body, headers=headers) as response:
                ok = response.status == 200
                parsed: dict[str, Any] = await response.json() if ok else {}
                return response.status, parsed

        yield post_aiohttp


def client_errors(kind: str) -> tuple[type[BaseException], ...]:
    if kind == "httpx":
        return (httpx.HTTPError,)
    import aiohttp

    return (aiohttp.ClientError, asyncio.TimeoutError)


async def drive(
    url: str,
    work: list[tuple[int, list[list[float]]]],
    *,
    concurrency: int,
    system: str,
    client: str = "aiohttp",
) -> list[Record]:
    """Closed loop: `concurrency` workers take the next request until the list is done."""
    parse = parse_momlp if system == "momlp" else parse_rayserve
    records: list[Record | None] = [None] * len(work)
    cursor = iter(range(len(work)))
    errors = client_errors(client)
    async with http_client(client, concurrency) as post:

        async def worker() -> None:
            for index in cursor:
                expert_id, rows = work[index]
                start = time.perf_counter()
                try:
                    status, body = await post(
                        url,
                        {"inputs": rows, "return_stats": True},
                        {"serve_multiplexed_model_id": str(expert_id)},
                    )
                    ok = status == 200
                except errors:
                    ok, body = False, {}
                latency = time.perf_counter() - start
                if not ok:
                    records[index] = Record(latency, False)
                    continue
                hits, misses, resident = parse(body)
                keep = body["outputs"] if index < 32 else None
                records[index] = Record(latency, True, hits, misses, resident, keep)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in records if r is not None]


# The fields of a `summarize` line that the single-system scripts (serve_ab.py,
# rayserve_configs.py) print per trial.
KEPT = (
    "rows_per_s", "p50_ms", "p99_ms", "errors", "hit_rate",
    "cpu_ms_per_row_serving", "cpu_ms_per_row_client", "cpu_cores_busy",
)  # fmt: skip


def summarize(
    system: str,
    records: list[Record],
    warmup: int,
    seconds: float,
    round_: int,
    *,
    rows_per_request: int,
    cpu: dict[str, float],
) -> dict[str, Any]:
    measured = records[warmup:]
    ok = [r for r in measured if r.ok]
    latencies = sorted(r.latency_s * 1000 for r in ok)
    hits = sum(r.hits for r in ok)
    misses = sum(r.misses for r in ok)
    peak: dict[str, int] = {}
    for record in records:
        for actor, nbytes in record.resident.items():
            peak[actor] = max(peak.get(actor, 0), nbytes)
    return {
        "benchmark": "vs_ray_serve",
        "system": system,
        "round": round_,
        "requests": len(measured),
        "errors": len(measured) - len(ok),
        "rows_per_s": len(ok) * rows_per_request / seconds if seconds > 0 else 0.0,
        "p50_ms": float(np.percentile(latencies, 50)) if latencies else None,
        "p99_ms": float(np.percentile(latencies, 99)) if latencies else None,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        # Sum over actors of each actor's largest resident figure seen in an answer.
        "peak_resident_bytes": sum(peak.values()),
        # CPU per measured row, serving side (server, Ray, actors/replicas, proxy) and client.
        "cpu_ms_per_row_serving": 1000 * cpu["serving"] / max(1, len(ok) * rows_per_request),
        "cpu_ms_per_row_client": 1000 * cpu["client"] / max(1, len(ok) * rows_per_request),
        "cpu_cores_busy": (cpu["serving"] + cpu["client"]) / seconds if seconds > 0 else 0.0,
    }


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep this process's cyclic GC off what existed before the measured phase.

    This process is every system's load generator and the in-process limit, and it holds
    torch, Ray and Ray Serve's client: a full collection of that heap took 185-196 ms and
    stalled all 16 clients at once, which was the stray ~200 ms p99 of one momlp round in most
    runs (benchmarks/RESULTS.md, "full collections"). Young collections still run.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def ratio_arithmetic(
    momlp: dict[str, float], peer: dict[str, float], limit: dict[str, float], goal: float = 3.0
) -> dict[str, float]:
    """Why the rows/s ratio is what it is, from each system's median line.

    rows/s = cores busy / CPU per row (the client's CPU counted), so momlp's ratio to the peer
    is (cores busy, momlp / peer) / (CPU per row, momlp / peer) to within the error of the
    medians. The last two fields compare momlp's serving CPU per row with the in-process
    limit's: what it spent, and what `goal` times the peer's rows/s would allow it at the
    cores it keeps busy (RESULTS.md, "Where issue 19 stands").
    """
    cores = momlp["cpu_cores_busy"] / peer["cpu_cores_busy"]
    momlp_row = momlp["cpu_ms_per_row_serving"] + momlp["cpu_ms_per_row_client"]
    peer_row = peer["cpu_ms_per_row_serving"] + peer["cpu_ms_per_row_client"]
    allowed_row = 1000.0 * momlp["cpu_cores_busy"] / (goal * peer["rows_per_s"])
    return {
        "cores_busy_ratio": cores,
        "cpu_per_row_ratio_with_client": momlp_row / peer_row,
        "rows_per_s_ratio_predicted": cores / (momlp_row / peer_row),
        "serving_cpu_per_row_to_limit": momlp["cpu_ms_per_row_serving"]
        / limit["cpu_ms_per_row_serving"],
        f"serving_cpu_per_row_to_limit_for_{goal:g}x": (
            allowed_row - momlp["cpu_ms_per_row_client"]
        )
        / limit["cpu_ms_per_row_serving"],
    }


def run_driver(
    url: str,
    work: list[tuple[int, list[list[float]]]],
    warmup: int,
    concurrency: int,
    system: str,
    serving_pid: int,
    client: str = "aiohttp",
) -> tuple[list[Record], float, dict[str, float]]:
    def run(part: list[tuple[int, list[list[float]]]]) -> list[Record]:
        return asyncio.run(
            drive(url, part, concurrency=concurrency, system=system, client=client)
        )

    warm = run(work[:warmup])
    with frozen_heap():
        meter = CpuMeter(serving_pid)
        start = time.perf_counter()
        rest = run(work[warmup:])
        seconds = time.perf_counter() - start
        cpu = meter.elapsed()
    return warm + rest, seconds, cpu


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


def prepare(
    args: argparse.Namespace,
) -> tuple[Store, tuple[int, ...], int, list[tuple[int, list[list[float]]]]]:
    """The store (built on first use), its widths and largest expert, and the workload; sets
    `args.budget` (bytes per actor) from `--experts-per-actor`."""
    torch.set_num_threads(1)
    widths = tuple(int(w) for w in args.widths.split(","))
    store = open_or_build(args.store, experts=args.experts, widths=widths, seed=args.seed)
    expert_bytes = max(store.expert_nbytes(e) for e in range(store.manifest.num_experts))
    args.budget = args.experts_per_actor * expert_bytes
    work = make_workload(
        store,
        count=args.warmup + args.requests,
        seed=args.seed,
        rows_per_request=args.rows_per_request,
    )
    return store, widths, expert_bytes, work


def add_workload_args(
    parser: argparse.ArgumentParser,
    *,
    store: str = "momlp-vs-rs",
    experts: int = 256,
    widths: str = "32,512,512,8",
    experts_per_actor: int = 16,
    rows_per_request: int = 1,
) -> None:
    """The store, actor and load flags that `prepare` reads, shared by the serving benchmarks
    (defaults: this script's workload; `store` is a folder in the temporary directory)."""
    parser.add_argument("--store", type=Path, default=Path(tempfile.gettempdir()) / store)
    parser.add_argument("--experts", type=int, default=experts)
    parser.add_argument("--widths", default=widths, help="expert widths d0,...,dout")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--experts-per-actor", type=int, default=experts_per_actor)
    parser.add_argument(
        "--rows-per-request",
        type=int,
        default=rows_per_request,
        help="rows in each request (the issue's independent run used 4)",
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ray-num-cpus", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="load generator's HTTP client: aiohttp (C parser, ~0.1 ms CPU a request) or "
        "httpx (~1.4 ms; what runs before 2026-11-23's fifth session used)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rayserve-config",
        choices=("best", "default"),
        default="best",
        help="Ray Serve's documented high-throughput settings (best) or its defaults",
    )
    add_rayserve_args(parser)
    parser.add_argument(
        "--quick", action="store_true", help="about a minute: 1 round of 600 requests"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.warmup = 1, 600, 100
    store, widths, expert_bytes, work = prepare(args)
    setup = {
        "experts": store.manifest.num_experts,
        "widths": list(widths),
        "expert_bytes": expert_bytes,
        "actors": args.actors,
        "budget_bytes_per_actor": args.budget,
        "experts_per_actor": args.experts_per_actor,
        "requests": args.requests,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "client": args.client,
        "batch": args.rows_per_request,
        "distribution": "zipf:1.0",
        "rayserve_config": args.rayserve_config,
        "rayserve_max_ongoing": peer_max_ongoing(args),
        "rayserve_proxy": args.rayserve_proxy,
        "rayserve_batch": args.rayserve_batch,
        "rayserve_batch_wait_ms": args.rayserve_batch_wait_ms,
        "machine": MACHINE,
        "cpu": cpu_facts(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    runners = {"momlp": run_momlp, "ray_serve": run_rayserve, "in_process": run_inprocess}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    outputs: dict[str, list[Any]] = {}
    for round_ in range(args.rounds):
        # The two servers alternate who goes first; the in-process limit runs last.
        servers = ["momlp", "ray_serve"] if round_ % 2 == 0 else ["ray_serve", "momlp"]
        order = [*servers, "in_process"]
        for system in order:
            records, seconds, cpu = runners[system](args, store, work, round_)
            line = summarize(
                system,
                records,
                args.warmup,
                seconds,
                round_,
                rows_per_request=args.rows_per_request,
                cpu=cpu,
            )
            line |= setup
            results[system].append(line)
            outputs.setdefault(system, [r.outputs for r in records[:32]])
            print(json.dumps(line), flush=True)
    medians: dict[str, dict[str, Any]] = {}
    for system, lines in results.items():
        keys = (
            "rows_per_s",
            "p50_ms",
            "p99_ms",
            "hit_rate",
            "peak_resident_bytes",
            "cpu_ms_per_row_serving",
            "cpu_ms_per_row_client",
            "cpu_cores_busy",
        )
        medians[system] = {
            key: statistics.median(v for v in (line[key] for line in lines) if v is not None)
            for key in keys
        }
        head = {"benchmark": "vs_ray_serve", "system": system, "stat": "median"}
        line = head | {"rounds": args.rounds} | medians[system] | setup
        print(json.dumps(line), flush=True)
    same = all(
        a is not None
        and b is not None
        and c is not None
        and np.allclose(a, b, rtol=1e-4, atol=1e-5)
        and np.allclose(a, c, rtol=1e-4, atol=1e-5)
        for a, b, c in zip(
            outputs["momlp"], outputs["ray_serve"], outputs["in_process"], strict=True
        )
    )
    m, r, limit = medians["momlp"], medians["ray_serve"], medians["in_process"]
    comparison = {
        "benchmark": "vs_ray_serve",
        "stat": "ratio momlp / ray_serve (medians)",
        "rows_per_s_ratio": m["rows_per_s"] / r["rows_per_s"],
        "p99_ratio": m["p99_ms"] / r["p99_ms"],
        # Paired within a round (same machine load), then the median over rounds.
        "rows_per_s_ratio_paired": statistics.median(
            a["rows_per_s"] / b["rows_per_s"]
            for a, b in zip(results["momlp"], results["ray_serve"], strict=True)
        ),
        "p99_ratio_paired": statistics.median(
            a["p99_ms"] / b["p99_ms"]
            for a, b in zip(results["momlp"], results["ray_serve"], strict=True)
        ),
        "rows_per_s_ratio_to_in_process_limit": m["rows_per_s"] / limit["rows_per_s"],
        "rows_per_s_ratio_to_limit_paired": statistics.median(
            a["rows_per_s"] / b["rows_per_s"]
            for a, b in zip(results["momlp"], results["in_process"], strict=True)
        ),
        # Serving-side CPU per row: what bounds rows/s once the cores are saturated.
        "cpu_per_row_serving_ratio": m["cpu_ms_per_row_serving"] / r["cpu_ms_per_row_serving"],
        **ratio_arithmetic(m, r, limit),
        "goal_half_of_limit": m["rows_per_s"] >= 0.5 * limit["rows_per_s"],
        "goal_rows_per_s_3x": m["rows_per_s"] >= 3 * r["rows_per_s"],
        "goal_p99_half": m["p99_ms"] <= 0.5 * r["p99_ms"],
        "same_outputs_first_32": same,
    }
    print(json.dumps(comparison | setup), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
