"""Running a build's training jobs: as Ray tasks (the default), or one by one in-process.

`plan_jobs` turns the driver's state into self-contained jobs (the baseline's and one per
expert, each with only its own rows); `train_on_ray` and `train_locally` run the same jobs
and return the same results, so a store built either way is served the same way. The local
executor exists for machines without Ray (a GPU box with torch only) and for debugging.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from experts_store import progress_bar

from ._baseline import baseline_arch
from ._config import BuildConfig, ResolvedTraining
from ._datasets import Dataset
from ._exceptions import BuildFailed
from ._tasks import ExpertJob, StateArrays, TrainSpec, baseline_job, expert_job

if TYPE_CHECKING:
    from experts_store import ExpertArch, StoreWriter

__all__ = [
    "JobPlan", "plan_jobs", "ray_runtime", "runtime", "train_locally", "train_on_ray",
]

logger = logging.getLogger(__name__)

Results = tuple[dict[int, dict[str, Any]], dict[str, Any] | None]


@dataclass(frozen=True)
class JobPlan:
    """The baseline's arguments (None: no baseline) and (job, x, y) per expert."""

    baseline: tuple[Any, ...] | None
    experts: list[tuple[ExpertJob, np.ndarray[Any, Any], np.ndarray[Any, Any]]]


def plan_jobs(
    config: BuildConfig,
    training: ResolvedTraining,
    dataset: Dataset,
    small_arch: ExpertArch,
    small_states: list[StateArrays] | None,
    assigned: np.ndarray[Any, np.dtype[np.int64]],
    writer: StoreWriter,
) -> JobPlan:
    spec = TrainSpec(
        task=dataset.task,
        loss=training.loss,
        num_classes=dataset.num_classes,
        epochs=config.epochs,
        lr=training.lr,
        batch_size=config.batch_size,
        optimizer=training.optimizer,
        seed=config.seed,
        torch_threads=config.torch_threads,
        select_epoch=config.select_epoch,
        validation_fraction=config.validation_fraction,
    )
    baseline: tuple[Any, ...] | None = None
    if config.baseline:
        arch = baseline_arch(
            dataset.input_dim,
            dataset.output_dim,
            width=config.width,
            depth=training.depth,
            num_experts=config.experts,
            batchnorm=training.batchnorm,
            activation=config.expert_activation,
        )
        baseline = (
            arch.to_json(), dataclasses.replace(spec, epochs=training.baseline_epochs),
            dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test,
        )
    experts = []
    for expert_id in range(config.experts):
        rows = np.flatnonzero(assigned == expert_id)
        if rows.size == 0:
            logger.warning("expert %s has no training rows; it keeps its first weights", expert_id)
        marker = None
        if config.crash_once_expert == expert_id:
            marker = str(writer.expert_path(expert_id)) + ".crash-marker"
        job = ExpertJob(
            expert_id=expert_id,
            out_path=str(writer.expert_path(expert_id)),
            small_arch=small_arch.to_json(),
            extra_layers=training.depth - config.initial_depth,
            warmup_epochs=config.warmup_epochs,
            noise_std=config.noise_std,
            spec=spec,
            initial_state=None if small_states is None else small_states[expert_id],
            crash_marker=marker,
        )
        x = np.ascontiguousarray(dataset.x_train[rows])
        y = np.ascontiguousarray(dataset.y_train[rows])
        experts.append((job, x, y))
    return JobPlan(baseline=baseline, experts=experts)


def runtime(config: BuildConfig) -> Any:
    """The context the jobs run in: Ray (started if need be), or nothing for local."""
    if config.executor == "ray":
        return ray_runtime(config.ray_address, config.num_cpus)
    return nullcontext()


@contextmanager
def ray_runtime(address: str | None, num_cpus: int | None) -> Iterator[None]:
    """Use a running Ray, or start one (embedded, or joining --ray-address); stop only ours."""
    if address is None:
        # Read once, when `ray` is first imported: an embedded Ray then stays on loopback
        # (else Ray advertises the machine's outward address; `momlp` sets it first thing too).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    started = False
    if not ray.is_initialized():
        options: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
        if address is not None:
            options["address"] = address
        else:
            # address="local": a bare ray.init() would attach to any cluster `ray start` left.
            options.update(address="local", num_cpus=num_cpus, include_dashboard=False)
        try:
            ray.init(**options)
        except BaseException:
            # A signal during ray.init (SystemExit from wherever it is): what of an embedded
            # node is already up goes down now, as server.pool.start_ray does, though Ray does
            # not count itself initialised yet.
            with suppress(Exception):
                ray.shutdown()
            raise
        started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class _Progress:
    """The build's progress bar: jobs finished, the latest and mean expert losses."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = progress_bar(total, "experts", "task", enabled=enabled)
        self.results: dict[int, dict[str, Any]] = {}
        self.baseline: dict[str, Any] | None = None

    def done(self, owner: int | None, result: dict[str, Any]) -> None:
        if owner is None:
            self.baseline = result
            self._bar.set_postfix(baseline=f"{result['value']:.4g}")
        else:
            self.results[owner] = result
            losses = [
                r["final_loss"] for r in self.results.values() if math.isfinite(r["final_loss"])
            ]
            self._bar.set_postfix(
                last=f"{result['final_loss']:.4g}",
                mean=f"{(sum(losses) / len(losses)) if losses else float('nan'):.4g}",
            )
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


# The failures a job's second try could mend: memory or a device running out, a torch
# runtime error, an I/O hiccup (a crashed worker is retried by Ray whatever this says). Not
# a store that cannot be written (StoreWriteError: a full or read-only disk), nor a
# ValueError (weights that are not numbers: the same seed trains them again): a retry would
# train the expert again only to fail again, so the build fails at once.
_RETRIED: tuple[type[Exception], ...] = (RuntimeError, MemoryError, OSError)


def train_on_ray(plan: JobPlan, config: BuildConfig, progress: bool) -> Results:
    """One Ray task per job, retried by Ray (a crashed worker included)."""
    import ray

    use_gpu = ray.cluster_resources().get("GPU", 0) > 0  # type: ignore[no-untyped-call]
    resources: dict[str, Any] = {"num_gpus": 1} if use_gpu else {"num_cpus": 1}
    remote_opts: dict[str, Any] = {
        "max_retries": config.max_retries,
        "retry_exceptions": list(_RETRIED),
        **resources,
    }
    pending: dict[Any, int | None] = {}
    if plan.baseline is not None:
        # Submitted first: it is the longest task, so it should not start last.
        pending[ray.remote(baseline_job).options(**remote_opts).remote(*plan.baseline)] = None
    expert_remote = ray.remote(expert_job).options(**remote_opts)
    for job, x, y in plan.experts:
        # One object per cell: the task's node fetches only its own rows.
        pending[expert_remote.remote(job, ray.put(x), ray.put(y))] = job.expert_id
    bar = _Progress(len(pending), progress)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            owner = pending.pop(ready[0])
            try:
                result: dict[str, Any] = ray.get(ready[0])
            except ray.exceptions.RayError as exc:  # task error or dead worker, after retries
                _cancel_and_wait(list(pending))
                raise BuildFailed(expert_id=owner, reason=_task_reason(exc)) from exc
            bar.done(owner, result)
    finally:
        bar.close()
    return bar.results, bar.baseline


def _task_reason(exc: BaseException) -> str:
    """What a Ray task's failure says: its exception's type and message, as a local run's
    (its first line is Ray's colored `ray::expert_job() (pid=..., ip=...)`)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, Exception):
        return f"{type(cause).__name__}: {cause}"
    return re.sub(r"\x1b\[[0-9;]*m", "", str(exc).splitlines()[0] if str(exc) else repr(exc))


def _cancel_and_wait(refs: list[Any], timeout_s: float = 60.0) -> None:
    """Kill the tasks still running and wait until they have ended.

    A task that is still writing its expert into the staging directory while the writer
    removes it can recreate a file there mid-removal and leave the directory behind; so
    the failure is raised only once no task can write any more.
    """
    import ray

    for ref in refs:
        ray.cancel(ref, force=True)
    if not refs:
        return
    _, still = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if still:
        logger.warning("%d cancelled training tasks had not ended after %.0f s",
                       len(still), timeout_s)


def train_locally(plan: JobPlan, config: BuildConfig, progress: bool) -> Results:
    """Every job in this process, one after another, each retried like a Ray task."""
    bar = _Progress(len(plan.experts) + (plan.baseline is not None), progress)
    threads = torch.get_num_threads()  # each job sets its own; the driver keeps its count
    try:
        if plan.baseline is not None:
            baseline = plan.baseline
            bar.done(None, _attempt(None, config.max_retries, partial(baseline_job, *baseline)))
        for job, x, y in plan.experts:
            run = partial(expert_job, job, x, y)
            bar.done(job.expert_id, _attempt(job.expert_id, config.max_retries, run))
    finally:
        bar.close()
        torch.set_num_threads(threads)
    return bar.results, bar.baseline


def _attempt(
    owner: int | None, retries: int, job: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    for attempt in range(retries + 1):
        try:
            return job()
        except Exception as exc:  # what Ray's retry_exceptions=_RETRIED would retry
            if attempt == retries or not isinstance(exc, _RETRIED):
                raise BuildFailed(expert_id=owner, reason=f"{type(exc).__name__}: {exc}") from exc
            what = "the baseline" if owner is None else f"expert {owner}"
            logger.warning("training %s failed (%s); retrying", what, exc)
    raise AssertionError("unreachable")
