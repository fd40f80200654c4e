"""Train a mixture of expert PReLU MLPs (Algorithm 2 of the paper) and publish it as a store.

    from trainer import BuildConfig, build_store
    manifest = build_store(BuildConfig(out=Path("store"), dataset="ackley2d", experts=16))

Names are imported on first use, so that `momlp --help` (whose command registration
imports this package) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._baseline import baseline_arch, baseline_width
    from ._build import build_store, load_config_dataset
    from ._calibrate import TemperatureFit, calibrate_store, fit_temperature
    from ._config import QUICK_DEMO, BuildConfig, quick_demo_config, quick_overrides
    from ._datasets import (
        DATASET_NAMES,
        Dataset,
        Rows,
        ackley,
        fbm_path,
        load_data_file,
        make_dataset,
        rastrigin,
        read_data_file,
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
    "Rows",
    "TemperatureFit",
    "TrainResult",
    "TrainerError",
    "ackley",
    "baseline_arch",
    "baseline_width",
    "build_store",
    "calibrate_store",
    "class_weights",
    "evaluate_mixture",
    "fbm_path",
    "fit_temperature",
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
    "read_data_file",
    "regular_grid",
    "train_network",
]

_HOMES = {
    "baseline_arch": "trainer._baseline",
    "baseline_width": "trainer._baseline",
    "build_store": "trainer._build",
    "load_config_dataset": "trainer._build",
    "TemperatureFit": "trainer._calibrate",
    "calibrate_store": "trainer._calibrate",
    "fit_temperature": "trainer._calibrate",
    "QUICK_DEMO": "trainer._config",
    "BuildConfig": "trainer._config",
    "quick_demo_config": "trainer._config",
    "quick_overrides": "trainer._config",
    "DATASET_NAMES": "trainer._datasets",
    "Dataset": "trainer._datasets",
    "Rows": "trainer._datasets",
    "ackley": "trainer._datasets",
    "fbm_path": "trainer._datasets",
    "load_data_file": "trainer._datasets",
    "make_dataset": "trainer._datasets",
    "rastrigin": "trainer._datasets",
    "read_data_file": "trainer._datasets",
    "regular_grid": "trainer._datasets",
    "ExpertFileRef": "trainer._evaluate",
    "MixtureScore": "trainer._evaluate",
    "evaluate_mixture": "trainer._evaluate",
    "mixture_outputs": "trainer._evaluate",
    "BuildFailed": "trainer._exceptions",
    "ConfigError": "trainer._exceptions",
    "DataError": "trainer._exceptions",
    "TrainerError": "trainer._exceptions",
    "MixtureOfSmallNetworks": "trainer._prototypes",
    "kmeans_prototypes": "trainer._prototypes",
    "learned_prototypes": "trainer._prototypes",
    "TrainResult": "trainer._train",
    "class_weights": "trainer._train",
    "make_loss": "trainer._train",
    "predict": "trainer._train",
    "train_network": "trainer._train",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
