"""`build_store`: data → prototypes → tree → one Ray task per expert → evaluate → publish.

(With `executor="local"` the same jobs run one by one in this process instead; see
_executors.)

The driver holds the data, the prototypes and (with learned prototypes) the small networks
of the joint phase; the deepened experts exist only inside their tasks and in their files.
A build that cannot finish leaves no published store: StoreWriter discards its staging
directory when the `with` block exits with an exception.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from ._calibrate import fit_temperature
from ._config import BuildConfig, ResolvedTraining
from ._datasets import Dataset, load_data_file, make_dataset
from ._evaluate import ExpertFileRef, evaluate_mixture
from ._exceptions import BuildFailed, DataError
from ._executors import plan_jobs, runtime, train_locally, train_on_ray
from ._linear_gate import TemperatureSchedule, learned_linear_router
from ._prototypes import kmeans_prototypes, learned_prototypes
from ._tasks import StateArrays, pick_device
from ._train import make_loss, rescale_output, target_scaling

if TYPE_CHECKING:
    from experts_store import ExpertArch, Manifest

__all__ = ["build_store", "load_config_dataset"]

logger = logging.getLogger(__name__)


def load_config_dataset(config: BuildConfig) -> Dataset:
    """The dataset a config names, split and validated (DataError before any training)."""
    if config.dataset is not None:
        dataset = make_dataset(
            config.dataset,
            seed=config.seed,
            grid_size=config.grid_size,
            hurst=config.hurst,
            test_fraction=config.test_fraction,
        )
    else:
        assert config.data is not None
        dataset = load_data_file(
            config.data,
            target=config.target,
            task=config.task,
            seed=config.seed,
            test_fraction=config.test_fraction,
        )
    rows = dataset.x_train.shape[0]
    if rows < config.experts:
        raise DataError(
            f"{rows} training rows are fewer than the {config.experts} experts asked for",
            source=dataset.name,
        )
    held_out = dataset.x_test.shape[0]
    fits_temperature = (
        config.temperature is None and config.experts >= 2 and config.gate != "learned-linear"
    )
    if fits_temperature and held_out < 2:
        # τ is fitted on the held-out rows once every expert is trained: say so now.
        raise DataError(
            f"{held_out} held-out row is too few to fit the gate's temperature on (2 at least):"
            " raise --test-fraction, or give --temperature",
            source=dataset.name,
        )
    return dataset


def build_store(config: BuildConfig, progress: bool = True) -> Manifest:
    """Train a mixture on the config's data and publish it as a store at `config.out`."""
    from experts_store import ExpertArch, ExpertLoadError, StoreWriter
    from router import PrototypeTree, lift_rows

    timings: dict[str, float] = {}
    started = time.perf_counter()
    config.validate()
    dataset = load_config_dataset(config)
    training = config.resolve(dataset.task)
    timings["data_s"] = time.perf_counter() - started
    logger.info(
        "%s: %s train / %s test rows, %s → %s, %s experts",
        dataset.name, len(dataset.x_train), len(dataset.x_test),
        dataset.input_dim, dataset.output_dim, config.experts,
    )

    mark = time.perf_counter()
    small_arch = ExpertArch(
        widths=(dataset.input_dim, *(config.width,) * config.initial_depth, dataset.output_dim),
        batchnorm=training.batchnorm,
        activation=config.expert_activation,
    )
    prototypes, small_states = _discover_prototypes(config, training, dataset, small_arch)
    timings["prototypes_s"] = time.perf_counter() - mark
    logger.info("%s: prototypes (%s) in %.1f s", dataset.name, config.prototypes,
                timings["prototypes_s"])

    mark = time.perf_counter()
    lift = "linear" if config.gate == "learned-linear" else None
    tree = PrototypeTree.build(
        prototypes, branching=config.branching, seed=config.seed,
        temperature=_tree_temperature(config), balanced=config.balanced_tree,
    )
    # Training rows go to the expert the server's walk will reach: what is served was trained.
    x_route = torch.as_tensor(dataset.x_train)
    if lift is not None:
        x_route = lift_rows(x_route)
    assignment = tree.route(x_route, mode=config.routing).experts[:, 0]
    assigned = assignment.numpy()
    timings["tree_s"] = time.perf_counter() - mark

    with StoreWriter(config.out) as writer, runtime(config):
        tree.save(writer.router_path)
        mark = time.perf_counter()
        plan = plan_jobs(config, training, dataset, small_arch, small_states, assigned, writer)
        run = train_on_ray if config.executor == "ray" else train_locally
        results, baseline = run(plan, config, progress)
        timings["train_s"] = time.perf_counter() - mark
        logger.info("%s: %s experts%s trained in %.1f s", dataset.name, config.experts,
                    " and the baseline" if baseline is not None else "", timings["train_s"])
        entries = {i: writer.register_expert_file(i) for i in range(config.experts)}
        mark = time.perf_counter()
        try:
            # Read as the server reads them (a staged file a link leads out of the store is
            # refused, as it would be once served): the figures are the served store's.
            score = evaluate_mixture(
                writer.router_path,
                config.routing,
                {i: ExpertFileRef(writer.expert_path(i), e.sha256) for i, e in entries.items()},
                dataset.x_test,
                dataset.y_test,
                dataset.task,
                dataset.output_dim,
                lift=lift,
                store_root=writer.root,
            )
            timings["evaluate_s"] = time.perf_counter() - mark
            mark = time.perf_counter()
            gate = _choose_gate(config, tree, writer, entries, dataset)
        except ExpertLoadError as exc:
            # Trained and written; what failed is reading it back as a server would.
            raise BuildFailed(
                expert_id=exc.expert_id, reason=str(exc), stage="evaluating"
            ) from exc
        if gate.temperature != tree.temperature:
            tree.with_temperature(gate.temperature).save(writer.router_path)
        timings["calibrate_s"] = time.perf_counter() - mark
        timings["total_s"] = time.perf_counter() - started
        params = [entries[i].params for i in range(config.experts)]
        report: dict[str, Any] = {
            "dataset": dataset.name,
            "task": dataset.task,
            "input_dim": dataset.input_dim,
            "output_dim": dataset.output_dim,
            "train_rows": int(dataset.x_train.shape[0]),
            "test_rows": int(dataset.x_test.shape[0]),
            "num_experts": config.experts,
            "branching": config.branching,
            "routing": config.routing,
            "prototypes": config.prototypes,
            "depth": training.depth,
            "width": config.width,
            "loss": training.loss,
            "lr": training.lr,
            "epochs": config.epochs,
            "select_epoch": config.select_epoch,
            "baseline_epochs": training.baseline_epochs if config.baseline else None,
            # Regression experts train on their own cell's standardised targets (TrainSpec).
            "final_loss_units": "standardised" if dataset.task == "regression" else "raw",
            "mixture": {"metric": score.metric, "value": score.value, "eval_s": score.seconds},
            "gate": gate.model_dump(),
            "baseline": baseline,
            "experts": [
                {
                    "id": i,
                    "train_samples": results[i]["train_samples"],
                    "test_samples": score.test_samples[i],
                    "params": entries[i].params,
                    "bytes": entries[i].bytes,
                    "final_loss": _finite_or_none(results[i]["final_loss"]),
                    # The metric on the expert's own training rows and its own test rows, in the
                    # targets' units: which cells carry the error, and whether they over-fit.
                    "train_metric": _finite_or_none(results[i]["train_metric"]),
                    "test_metric": score.by_expert[i],
                    # With --select-epoch best-validation: the rows held out of the cell, the
                    # expert on them, and the epoch kept (0: the weights it started from).
                    "validation_samples": results[i]["validation_samples"],
                    "validation_metric": _finite_or_none(results[i]["validation_metric"]),
                    "best_epoch": results[i]["best_epoch"],
                    "train_s": results[i]["train_seconds"],
                    **({"retried_after_crash": results[i]["retried_after_crash"]}
                       if config.crash_once_expert == i else {}),
                }
                for i in range(config.experts)
            ],
            "params_per_expert": {
                "min": min(params), "max": max(params), "mean": sum(params) / len(params)
            },
            "total_params": sum(params),
            "timings": timings,
            "config": config.to_json_dict(),
        }
        writer.write_report(report)
        extra: dict[str, Any] = {"dataset": dataset.name, "prototypes": config.prototypes}
        if dataset.task == "classification":
            extra["classes"] = dataset.classes
        manifest = writer.publish(
            task=dataset.task,
            input_dim=dataset.input_dim,
            output_dim=dataset.output_dim,
            routing=config.routing,
            branching=config.branching,
            extra=extra,
            gate=gate,
        )
    logger.info(
        "published %s: mixture %s %.6g, baseline %s",
        config.out, score.metric, score.value,
        "skipped" if baseline is None else f"{baseline['value']:.6g}",
    )
    return manifest


def _choose_gate(
    config: BuildConfig, tree: Any, writer: Any, entries: dict[int, Any], dataset: Dataset
) -> Any:
    """The store's gate: τ as configured, or fitted on the held-out split (experts never
    trained on it) for the top-2 and top-3 mixtures' loss."""
    from experts_store import GateSpec, load_frozen_expert

    hierarchy = {"branching": config.branching, "depth": int(tree.depth)}
    if config.gate == "learned-linear":
        return _linear_gate_spec(config, tree, dataset, hierarchy)
    if config.temperature is not None or config.experts < 2:
        if config.temperature is not None:
            return GateSpec(temperature=config.temperature, temperature_source="config",
                            hierarchy=hierarchy, tree_top_k="beam")
        return GateSpec(hierarchy=hierarchy, tree_top_k="beam")
    experts: dict[int, Any] = {}

    def forward(expert_id: int, rows: torch.Tensor) -> torch.Tensor:
        if expert_id not in experts:
            experts[expert_id] = load_frozen_expert(
                writer.expert_path(expert_id), "cpu",
                expected_sha256=entries[expert_id].sha256, expert_id=expert_id,
                store_root=str(writer.root),
            )
        with torch.inference_mode():
            return experts[expert_id](rows)  # type: ignore[no-any-return]

    fit = fit_temperature(
        tree, forward, dataset.x_test, dataset.y_test, dataset.task, mode=config.routing,
        tree_top_k="beam", source="the build's held-out test split",
    )
    return GateSpec(temperature=fit.temperature, temperature_source="calibrated",
                    calibration=fit.calibration, hierarchy=hierarchy, tree_top_k="beam")


def _router_schedule(config: BuildConfig) -> TemperatureSchedule:
    if config.gate_temperature_schedule is not None:
        return TemperatureSchedule(*config.gate_temperature_schedule)
    tau = config.temperature or 1.0
    return TemperatureSchedule(tau, tau)


def _tree_temperature(config: BuildConfig) -> float:
    if config.gate == "learned-linear":
        from router import lifted_temperature

        return lifted_temperature(_router_schedule(config).final)
    return config.temperature or 1.0


def _linear_gate_spec(
    config: BuildConfig, tree: Any, dataset: Dataset, hierarchy: dict[str, int]
) -> Any:
    """The learned-linear store's gate: its training τ (never fitted afterwards), served as
    the sqdist gate on lifted points at 2τ; how often the tree walk on lifted points finds
    the router's argmax is measured on the training rows and recorded, since tree mode is
    only an approximation of the linear gate."""
    from experts_store import GateSpec
    from router import lift_rows, linear_logits

    schedule = _router_schedule(config)
    x = torch.as_tensor(dataset.x_train)
    argmax = linear_logits(tree.prototypes, x).argmax(dim=1)
    walked = tree.route(lift_rows(x), mode="tree").experts[:, 0]
    how: dict[str, Any] = {
        "method": "linear softmax router trained jointly with the small networks; τ "
        + ("on a geometric schedule" if schedule.start != schedule.end else "fixed")
        + ", never learned (seed 002, Thm 3)",
        "router_temperature": schedule.final,
        "schedule": [schedule.start, schedule.end],
        "epochs": config.prototype_epochs,
        "served_as": "sqdist gate on lifted rows [x, 1, 0, 0] at temperature 2τ",
        "exact_mode": "exact: top-k and weights of softmax((w·x + b)/τ)",
        "tree_mode": "approximation: the tree walk on lifted points",
        "tree_top1_agreement_train": float((walked == argmax).double().mean()),
    }
    given = config.temperature is not None or config.gate_temperature_schedule is not None
    return GateSpec(temperature=tree.temperature,
                    temperature_source="config" if given else "default",
                    calibration=how, hierarchy=hierarchy, tree_top_k="beam", lift="linear")


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _discover_prototypes(
    config: BuildConfig, training: ResolvedTraining, dataset: Dataset, small_arch: ExpertArch
) -> tuple[torch.Tensor, list[StateArrays] | None]:
    """Prototypes [K, n], and the small networks trained with them (learned mode only)."""
    from experts_store import ExpertMLP

    if config.prototypes == "kmeans" and config.gate != "learned-linear":
        return kmeans_prototypes(dataset.x_train, config.experts, seed=config.seed), None
    generator = torch.Generator().manual_seed(config.seed)
    networks = [ExpertMLP(small_arch, generator=generator) for _ in range(config.experts)]
    # On the device the experts train on: at full scale this phase is hundreds of thousands of
    # small steps, and on one CPU thread beside a GPU it outlasted the experts' whole training.
    device = pick_device()
    x = torch.as_tensor(dataset.x_train).to(device)
    y = torch.as_tensor(dataset.y_train).to(device)
    if dataset.task == "regression":
        # Trained on standardised targets like the experts (see TrainSpec), handed on raw.
        mean, std = target_scaling(y)
        y = (y - mean) / std
    loss_fn = make_loss(training.loss, y, dataset.num_classes)
    if config.gate == "learned-linear":
        from router import linear_lift

        weights, biases = learned_linear_router(
            x, y, networks, loss_fn=loss_fn, schedule=_router_schedule(config),
            epochs=config.prototype_epochs, lr=training.lr, router_lr=training.prototype_lr,
            batch_size=config.batch_size, optimizer=training.optimizer, generator=generator,
        )
        prototypes = linear_lift(weights, biases)  # the router, as lifted prototypes
    else:
        prototypes = learned_prototypes(
            x,
            y,
            networks,
            loss_fn=loss_fn,
            epochs=config.prototype_epochs,
            lr=training.lr,
            prototype_lr=training.prototype_lr,
            batch_size=config.batch_size,
            optimizer=training.optimizer,
            generator=generator,
        )
    if dataset.task == "regression":
        for net in networks:
            rescale_output(net, std, mean)
    states = [
        {name: t.detach().cpu().numpy().copy() for name, t in net.state_dict().items()}
        for net in networks
    ]
    return prototypes, states
