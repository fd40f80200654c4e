"""`momlp build --kind hyper`: train a hypernetwork (and optionally the embedding baseline
beside it) and publish it as a store of kind "hyper".

    manifest = build_hyper_store(HyperBuildConfig(out=Path("hyper-store"),
                                                  dataset="rotate-digits", epochs=10))

The store holds f (`hyper-<sha16>.safetensors`), a table of named conditions
(`conditions-<sha16>.safetensors`: the first `named_conditions` distinct test conditions,
ids `test-0`, `test-1`, ...) and report.json with the test error of both models.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from experts_store import (
    ConditionTable,
    HyperFile,
    HyperSpec,
    Manifest,
    PrimaryArch,
    StoreWriter,
    ThetaSlotSpec,
    conditions_file_name,
    hypernetwork_file_name,
    progress_bar,
    save_conditions,
    save_hypernetwork,
)

from ._data import DATASET_NAMES, HyperDataset, make_hyper_dataset
from ._exceptions import HyperConfigError
from ._model import EmbeddingModel, HyperNetwork, count_parameters
from ._npz import check_split_options, load_npz_triples
from ._primary import PrimarySpec
from ._train import TrainSettings, evaluate_error, train_model

__all__ = [
    "HyperBuildConfig",
    "build_hyper_store",
    "hypernetwork_layers",
    "publish_hypernetwork",
]

# The rates the seed-001 benchmark found stable for plain SGD (benchmarks/seed001_hyper.py).
_DEFAULT_LR = {"hyper-synthetic": 0.1, "rotate-digits": 0.01}
MAX_NAMED_CONDITIONS = 100_000


@dataclass(frozen=True)
class HyperBuildConfig:
    """What `momlp build --kind hyper` trains; one of `dataset` and `data`."""

    out: Path
    dataset: str | None = None
    data: Path | None = None
    depth: int = 4
    width: int = 100
    hidden: tuple[int, ...] = (10,)
    bias: bool = False
    epochs: int = 10
    lr: float | None = None
    batch_size: int = 64
    seed: int = 0
    baseline: Literal["embedding"] | None = None
    named_conditions: int = 16
    test_fraction: float = 0.2

    def __post_init__(self) -> None:
        if (self.dataset is None) == (self.data is None):
            raise HyperConfigError("give exactly one of dataset and data", option="dataset")
        if self.dataset is not None and self.dataset not in DATASET_NAMES:
            raise HyperConfigError(
                f"unknown {self.dataset!r}; known: {', '.join(DATASET_NAMES)}", option="dataset"
            )
        if not 0 <= self.named_conditions <= MAX_NAMED_CONDITIONS:
            raise HyperConfigError(
                f"must be in [0, {MAX_NAMED_CONDITIONS}]", option="named_conditions"
            )
        if self.depth < 0 or self.width < 1 or self.epochs < 1:
            raise HyperConfigError("need depth >= 0, width >= 1, epochs >= 1", option="depth")
        check_split_options(self.test_fraction, self.seed)


def hypernetwork_layers(model: HyperNetwork) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """f's linear layers (weight, bias) in order, as the store's hypernetwork file holds them."""
    return [(m.weight, m.bias) for m in model.f if isinstance(m, torch.nn.Linear)]


class _Progress:
    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar = progress_bar(total, desc, "epoch", enabled=enabled)

    def __call__(self, epoch: int, loss: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4g}")
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _train(model: torch.nn.Module, data: HyperDataset, settings: TrainSettings,
           progress: bool, desc: str) -> dict[str, Any]:
    bar = _Progress(progress, settings.epochs, desc)
    try:
        history = train_model(model, data, settings, on_epoch=bar)
    finally:
        bar.close()
    metric = "error_rate" if data.task == "classification" else "mse"
    return {
        "metric": metric,
        "value": evaluate_error(model, data),
        "params": count_parameters(model),
        "train_s": history.seconds,
        "final_loss": history.losses[-1] if history.losses else None,
        "diverged": history.diverged,
    }


def _named_table(data: HyperDataset, count: int) -> torch.Tensor:
    """The first `count` distinct test conditions, in test order (reproducible ids)."""
    seen: dict[bytes, int] = {}
    for i, row in enumerate(data.condition_test.numpy()):
        if len(seen) >= count:
            break
        seen.setdefault(row.tobytes(), i)
    return data.condition_test[list(seen.values())]


def build_hyper_store(config: HyperBuildConfig, progress: bool = True) -> Manifest:
    """Train f (and the baseline when asked), then publish the store at `config.out`."""
    started = time.perf_counter()
    if config.dataset is not None:
        data = make_hyper_dataset(config.dataset, seed=config.seed)
    else:
        assert config.data is not None
        data = load_npz_triples(config.data, config.test_fraction, config.seed)
    name = config.dataset or "data"
    settings = TrainSettings(
        lr=config.lr if config.lr is not None else _DEFAULT_LR.get(name, 0.01),
        batch_size=config.batch_size, epochs=config.epochs, seed=config.seed,
    )
    primary = PrimarySpec(data.input_dim, config.hidden, data.output_dim, bias=config.bias)
    torch.manual_seed(config.seed)
    f = HyperNetwork(data.condition_dim, primary, depth=config.depth, width=config.width)
    report: dict[str, Any] = {"kind": "hyper", "dataset": data.name, "task": data.task,
                              "train_rows": int(data.x_train.shape[0]),
                              "test_rows": int(data.x_test.shape[0]),
                              "settings": vars(settings) | {"depth": config.depth}}
    report["hypernetwork"] = _train(f, data, settings, progress, "hypernetwork")
    report["hypernetwork"]["theta_params"] = f.primary_parameters()
    report["baseline"] = None
    if config.baseline == "embedding":
        torch.manual_seed(config.seed)
        q = EmbeddingModel(data.condition_dim, data.input_dim, data.output_dim,
                           depth=config.depth, width=config.width, hidden=config.hidden[0])
        report["baseline"] = _train(q, data, settings, progress, "embedding")
        report["baseline"]["embedding_dim"] = q.embedding_dim
    named = _named_table(data, config.named_conditions)
    report["timings"] = {"total_s": time.perf_counter() - started}
    return publish_hypernetwork(
        config.out, f, task=data.task, conditions=named,
        condition_ids=[f"test-{i}" for i in range(named.shape[0])], report=report,
    )


def publish_hypernetwork(
    out: Path,
    f: HyperNetwork,
    *,
    task: Literal["regression", "classification"] = "regression",
    conditions: torch.Tensor | None = None,
    condition_ids: Sequence[str] = (),
    report: dict[str, Any] | None = None,
    router: Any = None,
) -> Manifest:
    """Publish `f` (trained or not) as a store of kind "hyper" at `out`, with an optional
    table of named conditions [C, m2]; returns the manifest.

    With `router` (a `PrototypeTree` over the table's rows) the store is prototype-conditioned:
    a row is routed to its nearest prototype p_k (exact) and served by g(·; f(p_k)).
    HyperConfigError, before anything is written, for a g whose activation is not ReLU
    (option `primary.activation`: a store serves g with ReLU only) and for a table that is
    not [C, m2] (option `conditions`).
    """
    primary = f.primary
    if primary.activation != "relu":
        # A store's g is served as an expert MLP whose activation is PReLU with γ = 0, i.e.
        # ReLU (experts_store.PrimaryArch knows no other): any other g would be published as
        # ReLU and served as a different function from the one trained.
        raise HyperConfigError(
            f"a hyper store serves g with ReLU; this f generates a g with "
            f"{primary.activation!r}",
            option="primary.activation",
        )
    if conditions is not None and conditions.numel() > 0 and (
        conditions.dim() != 2 or conditions.shape[1] != f.condition_dim
    ):
        # A server refuses to open a store whose table is not [C, m2]: refuse it here, before
        # a store that cannot be served goes live.
        raise HyperConfigError(
            f"a table of shape {list(conditions.shape)}; f takes conditions of "
            f"{f.condition_dim} values ([C, {f.condition_dim}])",
            option="conditions",
        )
    with StoreWriter(out) as writer:
        if router is not None:
            router.save(writer.router_path)
        staged = writer.staging / "hyper.safetensors"
        f_sha = save_hypernetwork(hypernetwork_layers(f), staged)
        f_file = writer.kind_file(hypernetwork_file_name(f_sha), staged)
        table = None
        if conditions is not None and conditions.shape[0] > 0:
            staged_table = writer.staging / "conditions.safetensors"
            t_sha = save_conditions(conditions, list(condition_ids), staged_table)
            table = ConditionTable(
                file=writer.kind_file(conditions_file_name(t_sha), staged_table),
                sha256=t_sha, bytes=staged_table.stat().st_size, count=len(condition_ids),
            )
        layers = hypernetwork_layers(f)
        spec = HyperSpec(
            input_dim=primary.input_dim,
            condition_dim=f.condition_dim,
            output_dim=primary.output_dim,
            primary=PrimaryArch(widths=list(primary.widths), bias=primary.bias),
            hypernetwork=HyperFile(
                file=f_file, sha256=f_sha, bytes=staged.stat().st_size,
                params=sum(w.numel() + b.numel() for w, b in layers),
                widths=[f.condition_dim, *(int(w.shape[0]) for w, _ in layers)],
            ),
            layout=[ThetaSlotSpec(name=s.name, shape=list(s.shape), offset=s.offset)
                    for s in f.layout.slots],
            conditions=table,
            condition_source="prototype" if router is not None else "request",
        )
        if report is not None:
            writer.write_report(report)
        return writer.publish(
            task=task, input_dim=primary.input_dim, output_dim=primary.output_dim,
            routing="exact" if router is not None else "tree",
            branching=router.branching if router is not None else 2, kind="hyper", hyper=spec,
        )
