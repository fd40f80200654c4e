"""Patch-level mixture of experts (paper 003, pMoE): models, the digits-patches data, training.

    from trainer.pmoe import digits_patches, separate_pmoe, train_model, accuracy
    data = digits_patches(num_train=600, seed=0)
    model = separate_pmoe(num_patches=data.num_patches, patch_dim=data.patch_dim)
    train_model(model, data.x_train, data.y_train, "separate")
    accuracy(model, data.x_test, data.y_test)
    model.route(x).indices       # [B, k, l]: each expert's patches for each sample
"""

from __future__ import annotations

from ._build import PMOE_DATASETS, PMoEBuild, PMoEBuildConfig, build_pmoe
from ._cli import handle_pmoe_build
from ._data import (
    DIGITS_PATCH_SHAPE,
    PatchDataset,
    digits_patches,
    image_to_patches,
    patches_to_image,
)
from ._exceptions import PatchLayoutError, PMoEConfigError, PMoEError
from ._metrics import ClassGateHit, accuracy, discriminative_in_top, largest_gate_hits
from ._model import (
    Gating,
    OutputLayer,
    PatchCNN,
    PatchMoE,
    PatchRouting,
    as_patches,
    top_l_patches,
)
from ._publish import (
    PatchRoutingMode,
    expert_mlp,
    publish_pmoe,
    token_choice_logits,
    token_prototypes,
)
from ._train import (
    TrainHistory,
    TrainMode,
    TrainSettings,
    joint_pmoe,
    patch_cnn,
    predict_logits,
    separate_pmoe,
    train_model,
    train_router_linear,
)

__all__ = [
    "DIGITS_PATCH_SHAPE",
    "PMOE_DATASETS",
    "PMoEBuild",
    "PMoEBuildConfig",
    "PatchRoutingMode",
    "build_pmoe",
    "handle_pmoe_build",
    "expert_mlp",
    "publish_pmoe",
    "token_choice_logits",
    "token_prototypes",
    "ClassGateHit",
    "Gating",
    "OutputLayer",
    "PMoEConfigError",
    "PMoEError",
    "PatchCNN",
    "PatchDataset",
    "PatchLayoutError",
    "PatchMoE",
    "PatchRouting",
    "TrainHistory",
    "TrainMode",
    "TrainSettings",
    "accuracy",
    "as_patches",
    "digits_patches",
    "discriminative_in_top",
    "image_to_patches",
    "joint_pmoe",
    "largest_gate_hits",
    "patch_cnn",
    "patches_to_image",
    "predict_logits",
    "separate_pmoe",
    "top_l_patches",
    "train_model",
    "train_router_linear",
]
