"""Train a mixture of expert PReLU MLPs (Algorithm 2 of the paper) and publish it as a store.

    from trainer import BuildConfig, build_store
    manifest = build_store(BuildConfig(out=Path("store"), dataset="ackley2d", experts=16))
"""

from __future__ import annotations

from ._baseline import baseline_arch, baseline_width
from ._build import build_store, load_config_dataset
from ._config import QUICK_DEMO, BuildConfig, quick_demo_config, quick_overrides
from ._datasets import (
    DATASET_NAMES,
    Dataset,
    ackley,
    fbm_path,
    load_data_file,
    make_dataset,
    rastrigin,
    regular_grid,
)
from ._evaluate import ExpertFileRef, MixtureScore, evaluate_mixture, mixture_outputs
from ._exceptions import BuildFailed, ConfigError, DataError, TrainerError
from ._prototypes import MixtureOfSmallNetworks, kmeans_prototypes, learned_prototypes
from ._train import TrainResult, class_weights, make_loss, predict, train_network

__all__ = [
    "DATASET_NAMES",
    "QUICK_DEMO",
    "BuildConfig",
    "BuildFailed",
    "ConfigError",
    "DataError",
    "Dataset",
    "ExpertFileRef",
    "MixtureOfSmallNetworks",
    "MixtureScore",
    "TrainResult",
    "TrainerError",
    "ackley",
    "baseline_arch",
    "baseline_width",
    "build_store",
    "class_weights",
    "evaluate_mixture",
    "fbm_path",
    "kmeans_prototypes",
    "learned_prototypes",
    "load_config_dataset",
    "load_data_file",
    "make_dataset",
    "make_loss",
    "mixture_outputs",
    "predict",
    "quick_demo_config",
    "quick_overrides",
    "rastrigin",
    "regular_grid",
    "train_network",
]
