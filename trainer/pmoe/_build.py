"""`momlp build --kind pmoe`: data, training (trainer.pmoe), evaluation, publishing.

    build = build_pmoe(PMoEBuildConfig(out=Path("store"), num_experts=2, patches_per_expert=2,
                                       train="separate"))
    build.manifest, build.model          # the published manifest and the trained PatchMoE
    build.x_test, build.y_test           # the held-out samples the report's accuracy is on

Data: `digits-patches` (2 classes, 4x4 grids of 8x8 digits: n = 16, d = 64, images 32x32x1),
`digits-patches-4class` (digits 0-3 discriminative), or two .npy files: X as [N, n, d] or as
images [N, H, W, C] with `patch_shape`, and integer labels y [N] in 0..c-1 (c >= 2); a seeded
`test_fraction` of them is held out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from experts_store import ImageLayout, Manifest, progress_bar
from router import PrototypeTree

from .._arrays import (
    FLOAT32_MAX,
    UNREADABLE_ARRAY_FILE,
    class_count_problem,
    open_regular,
    unreadable_reason,
)
from ._data import DIGITS_PATCH_SHAPE, digits_patches, image_to_patches
from ._exceptions import PMoEConfigError
from ._metrics import accuracy
from ._model import PatchMoE
from ._publish import PatchRoutingMode, publish_pmoe, token_choice_logits, token_prototypes
from ._train import TrainSettings, joint_pmoe, patch_cnn, separate_pmoe, train_model

__all__ = ["MAX_SEED", "PMOE_DATASETS", "PMoEBuild", "PMoEBuildConfig", "build_pmoe"]

PMOE_DATASETS = ("digits-patches", "digits-patches-4class")
# numpy's seeding takes any non-negative integer, torch's at most 2**64 - 1; one bound for
# both (and the other kinds').
MAX_SEED = 2**32 - 1
_MAX_FILE_BYTES = 1 << 31


@dataclass(frozen=True)
class PMoEBuildConfig:
    """What `momlp build --kind pmoe` trains; defaults are the paper's Sec. 5.1 settings.

    `num_experts` None: one per class (separate) or 8 (joint). `hidden_total` neurons are
    shared among the experts (the CNN baseline gets all of them).
    """

    out: Path
    dataset: str | None = "digits-patches"
    data: tuple[Path, Path] | None = None
    patch_shape: tuple[int, int] | None = None
    train: Literal["separate", "joint"] = "separate"
    num_experts: int | None = None
    patches_per_expert: int = 2
    routing: PatchRoutingMode = "expert_choice"
    hidden_total: int = 40
    epochs: int = 150
    router_epochs: int = 100
    lr: float = 0.2
    batch_size: int = 20
    num_train: int = 1000
    num_test: int = 1000
    test_fraction: float = 0.3
    baseline: Literal["cnn"] | None = None
    seed: int = 0

    def validate(self) -> None:
        """PMoEConfigError naming the first option that cannot work, before any data is read."""
        if self.data is None and self.dataset not in PMOE_DATASETS:
            raise PMoEConfigError(f"unknown dataset {self.dataset!r}", option="dataset")
        at_least_one = {
            "num_experts": self.num_experts,
            "patches_per_expert": self.patches_per_expert,
            "hidden_total": self.hidden_total,
            "batch_size": self.batch_size,
            "num_train": self.num_train,
            "num_test": self.num_test,
        }
        for option, value in at_least_one.items():
            if value is not None and value < 1:
                raise PMoEConfigError(f"must be at least 1, got {value}", option=option)
        for option, value in (("epochs", self.epochs), ("router_epochs", self.router_epochs)):
            if value < 0:
                raise PMoEConfigError(f"must not be negative, got {value}", option=option)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise PMoEConfigError(f"must be a positive number, got {self.lr}", option="lr")
        if not 0.0 < self.test_fraction < 1.0:
            raise PMoEConfigError(f"must lie in (0, 1), got {self.test_fraction}",
                                  option="test_fraction")
        if not 0 <= self.seed <= MAX_SEED:
            raise PMoEConfigError(f"must be in [0, {MAX_SEED}], got {self.seed}", option="seed")
        if self.patch_shape is not None and self.data is None:
            raise PMoEConfigError("applies to image data given with --data X.npy y.npy; the"
                                  " built-in datasets come cut into patches", option="patch_shape")
        if self.patch_shape is not None and min(self.patch_shape) < 1:
            ph, pw = self.patch_shape
            raise PMoEConfigError(f"patch sides must be at least 1, got {ph}x{pw}",
                                  option="patch_shape")


@dataclass(frozen=True)
class PMoEBuild:
    manifest: Manifest
    model: PatchMoE
    tree: PrototypeTree | None
    x_test: torch.Tensor  # [N, n, d] float32
    y_test: torch.Tensor  # [N] int64
    report: dict[str, Any]


@dataclass(frozen=True)
class _Data:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    image: ImageLayout | None


def _digits(config: PMoEBuildConfig) -> _Data:
    four = config.dataset == "digits-patches-4class"
    data = digits_patches(
        num_train=config.num_train,
        num_test=config.num_test,
        discriminative=(0, 1, 2, 3) if four else (0, 1),
        seed=config.seed,
    )
    (rows, cols), (ph, pw) = data.grid, DIGITS_PATCH_SHAPE
    image = ImageLayout(
        height=rows * ph, width=cols * pw, channels=1, patch_height=ph, patch_width=pw
    )
    return _Data(
        data.name,
        torch.from_numpy(data.x_train),
        torch.from_numpy(data.y_train),
        torch.from_numpy(data.x_test),
        torch.from_numpy(data.y_test),
        data.num_classes,
        image,
    )


def _load_npy(path: Path) -> np.ndarray[Any, Any]:
    """The one array of an .npy file (np.save), never unpickling."""
    try:
        if path.stat().st_size > _MAX_FILE_BYTES:
            raise PMoEConfigError(f"{path} is larger than 2 GiB", option="data")
        # The file opened here, not by np.load: numpy leaves its own handle open when a
        # zip is damaged.
        with open_regular(path) as handle:
            loaded = np.load(handle, allow_pickle=False)
            if isinstance(loaded, np.lib.npyio.NpzFile):
                loaded.close()
                raise PMoEConfigError(
                    f"{path} is an .npz archive; --kind pmoe reads X and y as two .npy files "
                    "(np.save)", option="data",
                )
    except UNREADABLE_ARRAY_FILE as exc:
        raise PMoEConfigError(f"cannot read {path}: {unreadable_reason(exc)}",
                              option="data") from exc
    array: np.ndarray[Any, Any] = loaded
    return array


def _files(config: PMoEBuildConfig) -> _Data:
    assert config.data is not None
    x, y = (_load_npy(p) for p in config.data)
    if x.ndim not in (3, 4):
        raise PMoEConfigError(f"X must be [N, n, d] or [N, H, W, C], got {x.shape}", option="data")
    if len(x) == 0:
        raise PMoEConfigError(f"X holds no samples (shape {x.shape})", option="data")
    if x.dtype.kind != "f" or not np.isfinite(x).all():
        raise PMoEConfigError("X must hold finite floats", option="data")
    if x.size and float(np.abs(x).max()) > FLOAT32_MAX:
        # Finite here, infinite once cast to float32 for training.
        raise PMoEConfigError(
            f"X holds values beyond float32's range (|v| > {FLOAT32_MAX:.3g})", option="data"
        )
    if y.ndim != 1 or y.dtype.kind not in "iu" or len(y) != len(x):
        raise PMoEConfigError(
            f"y must be {len(x)} integer labels, got {y.dtype} of shape {y.shape}", option="data"
        )
    image = None
    if x.ndim == 3 and config.patch_shape is not None:
        raise PMoEConfigError(
            f"applies to images X [N, H, W, C]; X {list(x.shape)} is patches already",
            option="patch_shape",
        )
    if x.ndim == 4:
        if config.patch_shape is None:
            raise PMoEConfigError("image data [N, H, W, C] needs --patch-shape", option="data")
        (ph, pw), (_, h, w, c) = config.patch_shape, x.shape
        if min(h, w, c) < 1:
            raise PMoEConfigError(f"images [N, H, W, C] need H, W, C >= 1, got {x.shape}",
                                  option="data")
        if h % ph or w % pw:
            raise PMoEConfigError(
                f"{h}x{w} images (X {list(x.shape)}) do not split into {ph}x{pw} patches",
                option="patch_shape",
            )
        image = ImageLayout(height=h, width=w, channels=c, patch_height=ph, patch_width=pw)
        x = image_to_patches(x.astype(np.float32), config.patch_shape)
    classes = int(y.max()) + 1 if len(y) else 0
    if classes < 2 or int(y.min()) < 0:
        raise PMoEConfigError("labels must be 0..c-1 with c >= 2", option="data")
    problem = class_count_problem("y", y)
    if problem is not None:
        raise PMoEConfigError(problem, option="data")
    order = np.random.default_rng(config.seed).permutation(len(x))
    cut = int(round(len(x) * config.test_fraction))
    if not 0 < cut < len(x):
        raise PMoEConfigError("the test fraction leaves no train or no test rows", option="data")
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(y.astype(np.int64))
    test, train = torch.from_numpy(order[:cut]), torch.from_numpy(order[cut:])
    return _Data(config.data[0].stem, xt[train], yt[train], xt[test], yt[test], classes, image)


def _model(config: PMoEBuildConfig, data: _Data) -> PatchMoE:
    n, d = int(data.x_train.shape[1]), int(data.x_train.shape[2])
    common: dict[str, Any] = {
        "num_patches": n,
        "patch_dim": d,
        "num_classes": data.num_classes,
        "patches_per_expert": config.patches_per_expert,
        "hidden_total": config.hidden_total,
        "seed": config.seed,
    }
    if config.train == "separate":
        if config.num_experts not in (None, data.num_classes):
            raise PMoEConfigError(
                f"separate training has one expert per class ({data.num_classes})",
                option="num_experts",
            )
        experts = data.num_classes
    else:
        experts = 8 if config.num_experts is None else config.num_experts
    if config.hidden_total < experts:
        # Each expert gets hidden_total // experts neurons; below one each, the build raised
        # them to one without a word.
        raise PMoEConfigError(
            f"must be at least the {experts} experts its neurons are shared among, got"
            f" {config.hidden_total}", option="hidden_total",
        )
    if config.train == "separate":
        return separate_pmoe(**common)
    return joint_pmoe(**common, num_experts=experts)


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    bar = progress_bar(total, "pmoe", "epoch", enabled=enabled)
    try:
        yield bar
    finally:
        bar.close()


def build_pmoe(config: PMoEBuildConfig, progress: bool = True) -> PMoEBuild:
    """Train, evaluate and publish; PMoEConfigError (a TrainerError) before any training."""
    started = time.perf_counter()
    config.validate()
    data = _files(config) if config.data is not None else _digits(config)
    model = _model(config, data)
    router_epochs = config.router_epochs if config.train == "separate" else 0
    cnn_epochs = config.epochs if config.baseline == "cnn" else 0
    with _progress(progress, router_epochs + config.epochs + cnn_epochs) as bar:

        def on_epoch(stage: str, done: int) -> None:
            bar.set_postfix(stage=stage)
            bar.update(1)

        settings = TrainSettings(
            lr=config.lr,
            batch_size=config.batch_size,
            epochs=config.epochs,
            router_epochs=config.router_epochs,
            seed=config.seed,
            on_epoch=on_epoch,
        )
        history = train_model(model, data.x_train, data.y_train, config.train, settings)
        report: dict[str, Any] = {
            "kind": "pmoe",
            "dataset": data.name,
            "train": config.train,
            "routing": config.routing,
            "num_train": int(len(data.y_train)),
            "num_test": int(len(data.y_test)),
            "expert_choice_accuracy": accuracy(model, data.x_test.numpy(), data.y_test.numpy()),
            "final_loss": history.losses[-1] if history.losses else None,
            "train_s": history.seconds,
            "expert_macs_per_sample": model.expert_macs_per_sample(),
            "baseline": None,
        }
        if config.baseline == "cnn":
            cnn = patch_cnn(
                num_patches=model.num_patches,
                patch_dim=model.patch_dim,
                num_classes=data.num_classes,
                hidden=config.hidden_total,
                seed=config.seed,
            )
            train_model(cnn, data.x_train, data.y_train, "cnn", settings)
            report["baseline"] = {
                "model": "cnn",
                "accuracy": accuracy(cnn, data.x_test.numpy(), data.y_test.numpy()),
                "expert_macs_per_sample": cnn.expert_macs_per_sample(),
            }
    tree = None
    if config.routing == "token_choice":
        protos = token_prototypes(model, data.x_train)
        tree = PrototypeTree.build(protos, branching=min(4, max(2, model.num_experts)))
        logits = token_choice_logits(model, tree, data.x_test)
        hits = (logits.argmax(dim=1) == data.y_test).float().mean()
        report["token_choice_accuracy"] = float(hits)
    report["total_s"] = time.perf_counter() - started
    manifest = publish_pmoe(
        model,
        config.out,
        train=config.train,
        image=data.image,
        routing=config.routing,
        tree=tree,
        report=report,
    )
    return PMoEBuild(manifest, model, tree, data.x_test, data.y_test, report)
