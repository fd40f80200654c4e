"""The serving benchmarks' load generator: a closed-loop HTTP client sending a workload to
one system, the CPU it and the serving side spend, and the line that sums up a round."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

__all__ = [
    "KEPT",
    "CpuMeter",
    "Post",
    "Record",
    "client_errors",
    "drive",
    "frozen_heap",
    "http_client",
    "parse_momlp",
    "parse_rayserve",
    "run_driver",
    "summarize",
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
