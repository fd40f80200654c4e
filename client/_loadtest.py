"""`momlp loadtest` as a library: closed-loop (concurrency) or open-loop (Poisson rate) load.

`run_loadtest(config)` builds a route-verified workload, sends `POST /v1/predict` with
`return_stats=true` on every request, and returns a `LoadTestReport` (also written, when
`config.report_dir` is set, as report.json, report.html with its plots inlined, the PNG plots
and requests.csv). The clock, the sleep and the client are
injected so that tests drive it in-process against a fake server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ssl
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import httpx

from ._async_client import AsyncClient
from ._conditions import ConditionWorkload
from ._eval import EvalSet, load_eval_set
from ._html import write_html
from ._leases import ClientLeases
from ._loadtest_config import LoadTestConfig
from ._models import ModelInfo
from ._open_loop import open_loop_figures, open_loop_notes
from ._plots import matplotlib_available, write_plots
from ._records import RequestRecord, write_records_csv
from ._report import LoadTestReport, build_report
from ._runner import Clock, MonotonicClock, Runner, Sleep
from ._server_counts import counter_delta, read_counters
from ._workload import Distribution, Workload, build_workload

# Clock, LoadTestConfig and MonotonicClock live beside the runner and the checks; they are
# named here too because run_loadtest takes them, and callers import them from here.
__all__ = [
    "RECORDS_CSV_NAME",
    "Clock",
    "LoadTestConfig",
    "MonotonicClock",
    "arun_loadtest",
    "run_loadtest",
]

RECORDS_CSV_NAME = "requests.csv"

# Clients (one request in flight each) an open loop may hold; more arrivals wait for one.
MIN_OPEN_LOOP_CLIENTS = 100

ClientFactory = Callable[[LoadTestConfig], AsyncClient]


def default_client_factory(config: LoadTestConfig) -> AsyncClient:
    """A client for the load test's set-up, or for one request in flight at a time."""
    # Each client's transport would otherwise build its own TLS context, loading the CA
    # bundle (~17 ms on the 2-core VM), once for every client the leases make.
    transport = httpx.AsyncHTTPTransport(verify=_tls_context())
    return AsyncClient(
        config.url,
        api_key=config.api_key,
        timeout=config.timeout_s,
        max_retries=config.max_retries,
        transport=transport,
    )


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def run_loadtest(
    config: LoadTestConfig,
    *,
    client_factory: ClientFactory | None = None,
    clock: Clock | None = None,
    sleep: Sleep = asyncio.sleep,
    progress: TextIO | None = None,
    freeze_every: int = 0,
) -> LoadTestReport:
    """Run a load test to completion (blocking; starts its own event loop)."""
    return asyncio.run(
        arun_loadtest(
            config, client_factory=client_factory, clock=clock, sleep=sleep, progress=progress,
            freeze_every=freeze_every,
        )
    )


async def arun_loadtest(
    config: LoadTestConfig,
    *,
    client_factory: ClientFactory | None = None,
    clock: Clock | None = None,
    sleep: Sleep = asyncio.sleep,
    progress: TextIO | None = None,
    freeze_every: int = 0,
) -> LoadTestReport:
    """`run_loadtest` for callers already inside an event loop. `freeze_every`: see
    `Runner`; it freezes what is alive in the whole process out of the cyclic GC."""
    clock = clock or MonotonicClock()
    # Looked up at call time so that the CLI test can swap the factory for a fake transport.
    factory = client_factory or default_client_factory
    async with factory(config) as client:
        model = await client.model(include_prototypes=config.eval_data is None)
        workload: Workload | ConditionWorkload | None = None
        evaluation: EvalSet | None = None
        if config.conditions is not None:
            workload = ConditionWorkload(
                model, conditions=config.conditions,
                distribution=Distribution.parse(config.condition_distribution), seed=config.seed,
            )
        elif config.eval_data is not None:
            evaluation = load_eval_set(
                config.eval_data, task=model.task, input_dim=model.input_dim,
                output_dim=model.output_dim,
            )
            if config.requests is None and config.duration_s is None:
                # One pass: a row sent again would weigh twice in the score.
                config = dataclasses.replace(
                    config, requests=evaluation.requests_per_pass(config.batch)
                )
        else:
            workload = await build_workload(
                client,
                model,
                distribution=Distribution.parse(config.distribution),
                seed=config.seed,
                mode=config.mode,
                candidates_per_expert=config.candidates_per_expert,
                route_chunk_rows=config.route_chunk_rows,
            )
        # A closed loop never has more than `concurrency` requests in flight. In an open loop,
        # arrivals beyond the limit wait for a client (in their latency, which counts from
        # the scheduled arrival), as they waited for one of the shared pool's connections.
        in_flight_limit = max(MIN_OPEN_LOOP_CLIENTS, config.concurrency)
        leases = ClientLeases(
            lambda: factory(config), in_flight_limit, wait_s=config.timeout_s,
            url=f"{config.url.rstrip('/')}/v1/predict",
        )
        before = await read_counters(client)
        async with leases:
            runner = Runner(
                config, leases, workload, clock, sleep, progress, evaluation, freeze_every
            )
            await runner.run()
        server_counts = counter_delta(before, await read_counters(client))
    duration = max((record.end_s for record in runner.records), default=0.0)
    records = sorted(runner.records, key=lambda record: record.index)
    if isinstance(workload, ConditionWorkload):
        workload_info = workload.describe()
    elif workload is not None:
        workload_info = workload.describe()
        workload_info["expected_frequencies"] = {
            str(expert): share
            for expert, share in sorted(workload.expected_frequencies().items())
        }
    else:
        assert evaluation is not None
        workload_info = {"distribution": f"eval rows of {evaluation.path}",
                         "eval_rows": len(evaluation)}
    report = build_report(
        records,
        duration_s=duration,
        dense_equivalent_bytes=_dense_bytes(model),
        max_expert_bytes=model.max_expert_bytes,
        config=config.to_dict(),
        model=model.model_dump(exclude={"prototypes"}),
        workload=workload_info,
        save_requests=config.save_requests,
        accuracy=_accuracy(evaluation, records),
        server_counts=server_counts,
        max_failed_fraction=config.max_failed_fraction,
    )
    if config.rate is not None:
        figures = open_loop_figures(records, config.rate)
        report = replace(
            report,
            open_loop=figures,
            notes=[*report.notes, *open_loop_notes(figures, in_flight_limit=in_flight_limit)],
        )
    if config.report_dir is not None:
        report = _write(report, config, records)
    return report


def _dense_bytes(model: ModelInfo) -> int:
    """All experts resident at once, in the measure of `vram_bytes`: what an actor holds of
    each, its float32 parameters (a file's bytes add its safetensors header, which for small
    experts is as large as the weights)."""
    return 4 * model.total_params if model.total_params > 0 else model.total_expert_bytes


def _accuracy(
    evaluation: EvalSet | None, records: list[RequestRecord]
) -> dict[str, Any] | None:
    """The --eval figure over every answered row (repeats counted when the file wraps)."""
    if evaluation is None:
        return None
    total = sum(r.eval_sum for r in records if r.ok and r.eval_sum is not None)
    count = sum(r.eval_count for r in records if r.ok)
    return {
        "metric": evaluation.metric,
        "value": total / count if count else None,
        "task": evaluation.task,
        "rows": sum(r.rows for r in records if r.ok),
        "values": count,
        "data": evaluation.path,
    }


def _write(
    report: LoadTestReport, config: LoadTestConfig, records: list[RequestRecord]
) -> LoadTestReport:
    assert config.report_dir is not None
    directory = Path(config.report_dir)
    if config.plots and matplotlib_available():
        vram = [float(r.vram_bytes) for r in records if r.ok and r.vram_bytes is not None]
        paths = write_plots(report, directory, vram_samples=vram)
        report = replace(report, plots=[path.name for path in paths])
    elif config.plots:
        report = replace(report, notes=[*report.notes, "plots skipped: matplotlib not installed"])
    report.write(directory)
    write_html(report, directory)
    write_records_csv(records, directory / RECORDS_CSV_NAME)
    return report
