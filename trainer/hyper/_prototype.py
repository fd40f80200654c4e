"""Prototype-conditioned experts (`momlp build --kind hyper --condition-source prototype`).

Expert k of a mixture is g(·; f(p_k)): one hypernetwork f and the K prototypes stand for K
experts, so the store's size no longer grows with K (|f| + K·n floats instead of K·|g|).
Training: prototypes are K distinct training inputs drawn at random (k-means at K = 4,096 is
minutes on two cores); each training row goes to its nearest prototype (the router's exact
mode, which serving uses too), and f is trained on (x, p_{k(x)}, y).

    manifest = build_prototype_store(PrototypeBuildConfig(out=Path("s"), dataset="ackley2d",
                                                          experts=4096))
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from experts_store import Manifest

from ._data import HyperDataset
from ._exceptions import HyperConfigError
from ._model import HyperNetwork
from ._npz import check_split_options
from ._primary import PrimarySpec
from ._publish import _train, publish_hypernetwork

if TYPE_CHECKING:
    from trainer._datasets import Dataset

__all__ = ["PrototypeBuildConfig", "build_prototype_store"]


@dataclass(frozen=True)
class PrototypeBuildConfig:
    """A momlp regression dataset (`trainer.make_dataset` name) or a data file as the momlp
    kind reads it (`trainer.load_data_file`: an .npz with X, y, or a .csv/.parquet table whose
    `target` column is y)."""

    out: Path
    dataset: str | None = None
    data: Path | None = None
    target: str | None = None
    task: Literal["auto", "regression", "classification"] = "auto"
    test_fraction: float = 0.2
    experts: int = 256
    branching: int = 4
    depth: int = 2
    width: int = 100
    hidden: tuple[int, ...] = (10,)
    epochs: int = 10
    lr: float = 0.01
    batch_size: int = 64
    seed: int = 0
    grid_size: int | None = None

    def __post_init__(self) -> None:
        if (self.dataset is None) == (self.data is None):
            raise HyperConfigError("give exactly one of dataset and data", option="dataset")
        if self.experts < 1 or self.branching < 2:
            raise HyperConfigError("need experts >= 1 and branching >= 2", option="experts")
        check_split_options(self.test_fraction, self.seed)


def _load(config: PrototypeBuildConfig) -> Dataset:
    from trainer._datasets import load_data_file, make_dataset

    if config.dataset is not None:
        return make_dataset(config.dataset, seed=config.seed, grid_size=config.grid_size,
                            test_fraction=config.test_fraction)
    assert config.data is not None
    return load_data_file(config.data, target=config.target, task=config.task,
                          seed=config.seed, test_fraction=config.test_fraction)


def _triples(config: PrototypeBuildConfig) -> tuple[Any, torch.Tensor, HyperDataset, Any]:
    from router import PrototypeTree
    from trainer._exceptions import DataError

    try:
        data = _load(config)
    except DataError as exc:
        raise HyperConfigError(str(exc), option="dataset") from exc
    if data.task != "regression":
        raise HyperConfigError("prototype-conditioned stores are built for regression",
                               option="dataset")
    x_train = torch.from_numpy(np.asarray(data.x_train, dtype=np.float32))
    distinct = torch.unique(x_train, dim=0)
    if distinct.shape[0] < config.experts:
        raise HyperConfigError(
            f"{distinct.shape[0]} distinct training inputs for {config.experts} experts",
            option="experts",
        )
    pick = torch.randperm(distinct.shape[0], generator=torch.Generator().manual_seed(
        config.seed))[: config.experts]
    prototypes = distinct[pick].contiguous()
    tree = PrototypeTree.build(prototypes, branching=config.branching, seed=config.seed)

    def nearest(x: torch.Tensor) -> torch.Tensor:
        experts: torch.Tensor = tree.route(x, mode="exact").experts[:, 0]
        chosen: torch.Tensor = prototypes[experts]
        return chosen

    x_test = torch.from_numpy(np.asarray(data.x_test, dtype=np.float32))
    triples = HyperDataset(
        name=data.name, task="regression",
        x_train=x_train, condition_train=nearest(x_train),
        y_train=torch.from_numpy(np.asarray(data.y_train, dtype=np.float32)),
        x_test=x_test, condition_test=nearest(x_test),
        y_test=torch.from_numpy(np.asarray(data.y_test, dtype=np.float32)),
        output_dim=data.output_dim,
    )
    return data, prototypes, triples, tree


def build_prototype_store(config: PrototypeBuildConfig, progress: bool = True) -> Manifest:
    """Train f on (x, nearest prototype, y) and publish f, the prototypes and their tree."""
    from ._train import TrainSettings

    started = time.perf_counter()
    _, prototypes, triples, tree = _triples(config)
    torch.manual_seed(config.seed)
    n = triples.input_dim
    f = HyperNetwork(n, PrimarySpec(n, config.hidden, triples.output_dim), depth=config.depth,
                     width=config.width)
    settings = TrainSettings(lr=config.lr, batch_size=config.batch_size, epochs=config.epochs,
                             seed=config.seed)
    report: dict[str, Any] = {
        "kind": "hyper", "condition_source": "prototype", "dataset": triples.name,
        "experts": config.experts, "settings": vars(settings) | {"depth": config.depth},
        "hypernetwork": _train(f, triples, settings, progress, "hypernetwork"),
        "baseline": None,
    }
    report["timings"] = {"total_s": time.perf_counter() - started}
    return publish_hypernetwork(
        config.out, f, task="regression", conditions=prototypes,
        condition_ids=[str(k) for k in range(config.experts)], report=report, router=tree,
    )
