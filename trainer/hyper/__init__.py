"""Hypernetworks vs embeddings (paper 001): models, the θ layout, datasets, training.

    from trainer.hyper import (HyperNetwork, EmbeddingModel, PrimarySpec, generate,
                               primary_forward, primary_forward_stacked, stack_thetas,
                               rotate_digits, train_model, TrainSettings, evaluate_error)
    data = rotate_digits(seed=0)
    f = HyperNetwork(data.condition_dim, PrimarySpec(data.input_dim, (10,), 12), depth=4)
    train_model(f, data, TrainSettings(lr=0.01, epochs=10))
    theta = generate(f, data.condition_test[0])        # {"layers.0.weight": [10, 64], ...}
    primary_forward(data.x_test[:5], theta, f.primary)  # logits [5, 12]
    f.layout.slots                                      # names, shapes, offsets in f's output
"""

from __future__ import annotations

from ._data import (
    DATASET_NAMES,
    ROTATION_CLASSES,
    HyperDataset,
    angle_to_class,
    hyper_synthetic,
    make_hyper_dataset,
    rotate_digits,
    rotate_images,
)
from ._exceptions import HyperConfigError, HyperError, ThetaLayoutError
from ._model import (
    EmbeddingModel,
    HyperNetwork,
    count_parameters,
    generate,
    paper_embedding_dim,
)
from ._npz import load_npz_triples
from ._primary import (
    Activation,
    PrimarySpec,
    ThetaLayout,
    ThetaSlot,
    primary_forward,
    primary_forward_stacked,
    stack_thetas,
)
from ._prototype import PrototypeBuildConfig, build_prototype_store
from ._publish import (
    HyperBuildConfig,
    build_hyper_store,
    hypernetwork_layers,
    publish_hypernetwork,
)
from ._train import TrainHistory, TrainSettings, evaluate_error, predict, train_model

__all__ = [
    "DATASET_NAMES",
    "ROTATION_CLASSES",
    "Activation",
    "EmbeddingModel",
    "HyperBuildConfig",
    "HyperConfigError",
    "HyperDataset",
    "HyperError",
    "HyperNetwork",
    "PrimarySpec",
    "PrototypeBuildConfig",
    "ThetaLayout",
    "ThetaLayoutError",
    "ThetaSlot",
    "TrainHistory",
    "TrainSettings",
    "angle_to_class",
    "build_hyper_store",
    "build_prototype_store",
    "hypernetwork_layers",
    "load_npz_triples",
    "count_parameters",
    "generate",
    "hyper_synthetic",
    "make_hyper_dataset",
    "paper_embedding_dim",
    "predict",
    "publish_hypernetwork",
    "primary_forward",
    "primary_forward_stacked",
    "rotate_digits",
    "rotate_images",
    "stack_thetas",
    "evaluate_error",
    "train_model",
]
