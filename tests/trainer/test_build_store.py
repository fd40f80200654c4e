from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from experts_store import Store, load_expert
from trainer import BuildConfig, BuildFailed, DataError, build_store, load_config_dataset
from trainer._tasks import TrainSpec, validation_split

pytestmark = pytest.mark.ray

_GRID = {"holder1d": 200, "ackley2d": 12, "rastrigin2d": 12, "ackley3d": 6, "rastrigin3d": 6}


def tiny(out: Path, dataset: str, **changes: Any) -> BuildConfig:
    """A build small enough for a test: 4 narrow experts, a few epochs, a coarse grid."""
    fields: dict[str, Any] = {
        "out": out,
        "dataset": dataset,
        "experts": 4,
        "branching": 2,
        "width": 16,
        "prototype_epochs": 2,
        "warmup_epochs": 1,
        "epochs": 3,
        "batch_size": 64,
        "lr": 3e-3,
        "grid_size": _GRID.get(dataset),
    }
    fields.update(changes)
    return BuildConfig(**fields)


def own_tree_walk(router_file: Path, x: np.ndarray) -> np.ndarray:
    """Greedy descent written from the router file's arrays, row by row (float32 distances)."""
    tensors = load_file(str(router_file))
    prototypes = tensors["prototypes"].numpy()
    points = tensors["internal_points"].numpy()
    children = tensors["children"].numpy()
    num_internal = children.shape[0]
    nodes = np.concatenate([points, prototypes]).astype(np.float32)
    chosen = np.empty(len(x), dtype=np.int64)
    for row, q in enumerate(x.astype(np.float32)):
        node = 0
        while node < num_internal:
            kids = children[node][children[node] >= 0]
            d = ((q[None, :] - nodes[kids]) ** 2).sum(axis=1)
            node = int(kids[int(np.argmin(d))])
        chosen[row] = node - num_internal
    return chosen


def brute_force_nearest(prototypes: np.ndarray, x: np.ndarray) -> np.ndarray:
    d = ((x.astype(np.float64)[:, None, :] - prototypes.astype(np.float64)[None]) ** 2).sum(-1)
    return np.argmin(d, axis=1)


def recompute(
    config: BuildConfig,
) -> tuple[float, np.ndarray, np.ndarray, list[float | None], list[float | None]]:
    """(test metric, test rows per expert, train rows per expert, each expert's metric over its
    own test rows, and over its own training rows) from the published files."""
    store = Store.open(config.out)
    data = load_config_dataset(config)
    router_file = store.router_path
    if store.manifest.routing == "exact":
        protos = load_file(str(router_file))["prototypes"].numpy()
        test_ids = brute_force_nearest(protos, data.x_test)
        train_ids = brute_force_nearest(protos, data.x_train)
    else:
        test_ids = own_tree_walk(router_file, data.x_test)
        train_ids = own_tree_walk(router_file, data.x_train)
    k = store.manifest.num_experts

    def served(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        outputs = np.zeros((len(x), store.manifest.output_dim), dtype=np.float64)
        for entry in store.manifest.experts:
            rows = np.flatnonzero(ids == entry.id)
            if rows.size == 0:
                continue
            expert = load_expert(store.root / entry.file, expected_sha256=entry.sha256)
            with torch.no_grad():
                outputs[rows] = expert(torch.tensor(x[rows])).double().numpy()
        return outputs

    def score(outputs: np.ndarray, y: np.ndarray) -> float:
        if data.task == "classification":
            return float(np.mean(outputs.argmax(axis=1) == y))
        return float(np.mean((outputs - y.astype(np.float64)) ** 2))

    def per_expert(outputs: np.ndarray, y: np.ndarray, ids: np.ndarray) -> list[float | None]:
        return [
            score(outputs[ids == i], y[ids == i]) if np.any(ids == i) else None for i in range(k)
        ]

    on_test = served(data.x_test, test_ids)
    return (
        score(on_test, data.y_test),
        np.bincount(test_ids, minlength=k),
        np.bincount(train_ids, minlength=k),
        per_expert(on_test, data.y_test, test_ids),
        per_expert(served(data.x_train, train_ids), data.y_train, train_ids),
    )


@pytest.mark.parametrize(
    ("dataset", "routing", "prototypes"),
    [
        ("holder1d", "exact", "learned"),
        ("ackley2d", "tree", "learned"),
        ("ackley3d", "tree", "kmeans"),
        ("rastrigin2d", "exact", "kmeans"),
        ("rastrigin3d", "tree", "learned"),
        ("digits", "tree", "kmeans"),
    ],
)
def test_build_publishes_a_verified_store_whose_report_matches_the_served_mixture(
    ray_session: None, tmp_path: Path, dataset: str, routing: str, prototypes: str
) -> None:
    config = tiny(tmp_path / "store", dataset, routing=routing, prototypes=prototypes)
    manifest = build_store(config, progress=False)
    store = Store.open(config.out)
    assert store.verify() == []
    assert store.version == manifest.store_version
    assert (manifest.num_experts, manifest.branching, manifest.routing) == (4, 2, routing)
    assert manifest.task == ("classification" if dataset == "digits" else "regression")
    report = store.report()
    assert report is not None
    metric, test_counts, train_counts, on_test, on_train = recompute(config)
    # The report scored exactly what is served: same routing, same files.
    assert report["mixture"]["value"] == pytest.approx(metric, rel=1e-5, abs=1e-7)
    for field, expected in (("test_metric", on_test), ("train_metric", on_train)):
        assert [e[field] for e in report["experts"]] == [
            None if m is None else pytest.approx(m, rel=1e-5, abs=1e-7) for m in expected
        ], field
    assert [e["test_samples"] for e in report["experts"]] == test_counts.tolist()
    assert [e["train_samples"] for e in report["experts"]] == train_counts.tolist()
    assert report["baseline"]["metric"] == report["mixture"]["metric"]
    assert report["total_params"] == sum(e.params for e in manifest.experts)
    assert report["baseline"]["params"] > report["params_per_expert"]["max"]


def test_a_best_validation_build_holds_out_rows_of_each_cell_and_reports_them(
    ray_session: None, tmp_path: Path
) -> None:
    config = tiny(tmp_path / "store", "ackley2d", select_epoch="best-validation",
                  validation_fraction=0.2, epochs=6)
    build_store(config, progress=False)
    store = Store.open(config.out)
    report = store.report()
    assert report is not None and report["select_epoch"] == "best-validation"
    metric, _, train_counts, _, _ = recompute(config)
    assert report["mixture"]["value"] == pytest.approx(metric, rel=1e-5, abs=1e-7)
    data = load_config_dataset(config)
    train_ids = own_tree_walk(store.router_path, data.x_train)
    spec = TrainSpec(task="regression", loss="mse", num_classes=0, epochs=6, lr=3e-3,
                     batch_size=64, optimizer="adam", seed=config.seed,
                     select_epoch="best-validation", validation_fraction=0.2)
    for entry, reported in zip(store.manifest.experts, report["experts"], strict=True):
        rows = np.flatnonzero(train_ids == entry.id)
        fit, held = validation_split(len(rows), spec, salt=entry.id)
        expert = load_expert(store.root / entry.file, expected_sha256=entry.sha256)

        def mse(subset: np.ndarray, expert: Any = expert) -> float:
            with torch.no_grad():
                out = expert(torch.tensor(data.x_train[subset])).double().numpy()
            return float(np.mean((out - data.y_train[subset].astype(np.float64)) ** 2))

        assert reported["train_samples"] == train_counts[entry.id] == len(rows)
        assert reported["validation_samples"] == len(held) > 0
        assert reported["train_metric"] == pytest.approx(mse(rows[fit]), rel=1e-5)
        assert reported["validation_metric"] == pytest.approx(mse(rows[held]), rel=1e-5)
        assert 0 <= reported["best_epoch"] <= 6
    assert 0 <= report["baseline"]["best_epoch"] <= report["baseline_epochs"]


def test_a_killed_task_is_retried_and_the_build_still_publishes(
    ray_session: None, tmp_path: Path
) -> None:
    config = tiny(tmp_path / "store", "ackley2d", crash_once_expert=1, max_retries=2,
                  baseline=False)
    build_store(config, progress=False)
    store = Store.open(config.out)
    assert store.verify() == []
    report = store.report()
    assert report is not None
    assert report["experts"][1]["retried_after_crash"] is True
    assert report["baseline"] is None
    assert not list(config.out.rglob("*.crash-marker"))


def test_a_build_that_cannot_finish_leaves_the_previous_store(
    ray_session: None, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    first = build_store(tiny(out, "ackley2d", baseline=False), progress=False)
    failing = tiny(out, "ackley2d", crash_once_expert=0, max_retries=0, baseline=False, seed=1)
    with pytest.raises(BuildFailed) as info:
        build_store(failing, progress=False)
    assert info.value.expert_id == 0
    store = Store.open(out)
    assert store.version == first.store_version
    assert store.verify() == []
    assert not [p for p in out.iterdir() if p.name.startswith(".staging")]


def test_a_build_into_a_fresh_directory_that_fails_publishes_nothing(
    ray_session: None, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    failing = tiny(out, "ackley2d", crash_once_expert=2, max_retries=0, baseline=False)
    with pytest.raises(BuildFailed):
        build_store(failing, progress=False)
    # No manifest, no staging folder: the folder the build made for the store is gone too.
    assert not out.exists()


@pytest.mark.unit
def test_bad_data_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    x = np.ones((30, 2))
    x[3, 0] = np.inf
    np.savez(bad, X=x, y=np.zeros(30))
    out = tmp_path / "store"
    with pytest.raises(DataError, match="NaN or infinite"):
        build_store(BuildConfig(out=out, data=bad), progress=False)
    few = tmp_path / "few.npz"
    np.savez(few, X=np.random.default_rng(0).normal(size=(10, 2)), y=np.zeros(10))
    with pytest.raises(DataError, match="fewer than the 16 experts"):
        build_store(BuildConfig(out=out, data=few, experts=16), progress=False)
    assert not out.exists()


def test_report_json_is_plain_json(ray_session: None, tmp_path: Path) -> None:
    config = tiny(tmp_path / "store", "rastrigin2d", baseline=False, experts=3)
    build_store(config, progress=False)
    report = json.loads((config.out / "report.json").read_text())
    assert report["num_experts"] == 3
    assert set(report["timings"]) >= {"prototypes_s", "train_s", "evaluate_s", "total_s"}
    assert report["config"]["dataset"] == "rastrigin2d"


def test_the_local_executor_trains_the_same_experts_as_ray_tasks(
    ray_session: None, tmp_path: Path
) -> None:
    threads = torch.get_num_threads()
    built = {}
    for executor in ("ray", "local"):
        config = tiny(tmp_path / executor, "ackley2d", executor=executor)
        build_store(config, progress=False)
        built[executor] = Store.open(config.out)
    # The driver's torch threads are its own again after the local jobs set theirs.
    assert torch.get_num_threads() == threads
    ray_store, local_store = built["ray"], built["local"]
    for entry in ray_store.manifest.experts:
        a = load_expert(ray_store.root / entry.file).state_dict()
        b = load_expert(local_store.root / local_store.expert_entry(entry.id).file).state_dict()
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
    ray_report, local_report = ray_store.report(), local_store.report()
    assert ray_report is not None and local_report is not None
    assert local_report["mixture"]["value"] == pytest.approx(
        ray_report["mixture"]["value"], rel=1e-3
    )
    assert local_report["baseline"]["value"] == pytest.approx(
        ray_report["baseline"]["value"], rel=1e-3
    )


@pytest.mark.unit
def test_the_local_executor_retries_a_failing_job_and_publishes_nothing_when_it_keeps_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer._executors as executors

    real = executors.expert_job
    calls: dict[int, int] = {}

    def flaky(job: Any, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
        calls[job.expert_id] = calls.get(job.expert_id, 0) + 1
        if job.expert_id == 2 and (always or calls[2] == 1):
            raise RuntimeError("out of memory (simulated)")
        return real(job, x, y)

    monkeypatch.setattr(executors, "expert_job", flaky)
    always = False
    config = tiny(tmp_path / "store", "ackley2d", executor="local", baseline=False, max_retries=1)
    build_store(config, progress=False)
    assert calls[2] == 2 and Store.open(config.out).verify() == []

    always = True
    calls.clear()
    failing = tiny(tmp_path / "fresh", "ackley2d", executor="local", baseline=False,
                   max_retries=1)
    with pytest.raises(BuildFailed, match="expert 2 failed: RuntimeError: out of memory") as info:
        build_store(failing, progress=False)
    assert info.value.expert_id == 2 and calls[2] == 2
    assert not (failing.out / "manifest.json").exists()


@pytest.mark.unit
@pytest.mark.parametrize("failure", ["disk full", "nan weights"])
def test_a_failure_a_retry_cannot_mend_fails_the_build_without_training_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    import trainer._executors as executors
    from experts_store import StoreWriteError

    calls: dict[int, int] = {}

    def failing(job: Any, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
        calls[job.expert_id] = calls.get(job.expert_id, 0) + 1
        if failure == "disk full":
            raise StoreWriteError(path=job.out_path, reason="No space left on device")
        raise ValueError("linears.0.weight holds NaN or infinite values")

    monkeypatch.setattr(executors, "expert_job", failing)
    config = tiny(tmp_path / "store", "ackley2d", executor="local", baseline=False, max_retries=3)
    with pytest.raises(BuildFailed, match="expert 0 failed: (StoreWriteError|ValueError)"):
        build_store(config, progress=False)
    assert calls == {0: 1}  # once: a retry would train it again only to fail again
    assert not (config.out / "manifest.json").exists()


@pytest.mark.unit
def test_a_signal_during_ray_init_takes_down_the_part_of_ray_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ray.init answers SIGTERM with SystemExit from wherever it is; the build's Ray start left
    # what of the node was up running, where the server's start (server.pool) took it down.
    import ray

    from trainer._executors import ray_runtime

    calls: list[str] = []

    def init(**options: Any) -> None:
        calls.append("init")
        raise SystemExit(143)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(SystemExit), ray_runtime(None, 1):
        pass
    assert calls == ["init", "shutdown"]


def test_ray_tasks_retry_a_runtime_error_and_fail_at_once_on_a_value_error(
    ray_session: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ray is handed the retried types as a list (retry_exceptions): this runs them on Ray's
    # workers, where attempts are counted in files since each may run in another process.
    import trainer._executors as executors

    real = executors.expert_job
    attempts = tmp_path / "attempts"
    attempts.mkdir()

    def failing_once(failure: type[Exception]) -> Any:
        def job(job: Any, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
            if job.expert_id == 1:
                count = len(list(attempts.iterdir()))
                (attempts / str(count)).touch()
                if count == 0:
                    raise failure("simulated")
            return real(job, x, y)
        return job

    monkeypatch.setattr(executors, "expert_job", failing_once(RuntimeError))
    config = tiny(tmp_path / "store", "ackley2d", executor="ray", baseline=False, max_retries=2)
    build_store(config, progress=False)
    assert len(list(attempts.iterdir())) == 2 and Store.open(config.out).verify() == []

    for stale in attempts.iterdir():
        stale.unlink()
    monkeypatch.setattr(executors, "expert_job", failing_once(ValueError))
    failing = tiny(tmp_path / "fresh", "ackley2d", executor="ray", baseline=False,
                   max_retries=2)
    with pytest.raises(BuildFailed, match="expert 1 failed: ValueError: simulated"):
        build_store(failing, progress=False)
    assert len(list(attempts.iterdir())) == 1  # not retried: it would only fail again
    assert not (failing.out / "manifest.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_joint_phase_trains_on_it_like_the_experts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Until the fifty-sixth session the prototypes' phase ran on the CPU beside a GPU: with it
    # on one thread, four full-scale tasks ended no seed in a 470 s call (benchmarks/RESULTS.md).
    import trainer._build as build_module

    seen: list[torch.device] = []
    real = build_module.learned_prototypes

    def spy(x: torch.Tensor, y: torch.Tensor, networks: Any, **options: Any) -> torch.Tensor:
        seen.append(x.device)
        return real(x, y, networks, **options)

    monkeypatch.setattr(build_module, "learned_prototypes", spy)
    config = tiny(tmp_path / "store", "ackley2d", baseline=False, executor="local")
    build_store(config, progress=False)
    assert [d.type for d in seen] == ["cuda"]
    assert Store.open(config.out).verify() == []


@pytest.mark.unit
def test_a_ray_tasks_failure_is_named_by_its_cause_as_a_local_runs_is() -> None:
    # It was the first line of Ray's message: "\x1b[36mray::expert_job()\x1b[39m (pid=6909,
    # ip=127.0.0.1)", which says nothing of a full disk.
    from ray.exceptions import RayTaskError

    from experts_store import StoreWriteError
    from trainer._executors import _task_reason

    cause = StoreWriteError(path="/s/.staging-v/experts/2.safetensors",
                            reason="No space left on device")
    failed = RayTaskError("expert_job", "Traceback (most recent call last):\n  ...", cause)
    assert _task_reason(failed) == (
        "StoreWriteError: cannot write /s/.staging-v/experts/2.safetensors: No space left on "
        "device; nothing was published"
    )
    # The error crosses from the task's worker to the driver by pickle, fields and all.
    import pickle

    again = pickle.loads(pickle.dumps(cause))
    assert (type(again), again.path, again.reason, str(again)) == (
        StoreWriteError, cause.path, cause.reason, str(cause)
    )
