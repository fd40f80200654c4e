"""The two datasets of the paper-001 reproduction, as (x, condition I, y) triples.

    data = hyper_synthetic(seed=0)   # y = <x, h(I)>, h a sigmoid MLP with softmax on top (Fig. 1)
    data = rotate_digits(seed=0)     # x = digit rotated by a uniform angle, I = the upright digit,
                                     # y = nearest multiple of 30° (12 classes; Fig. 3, 7)

`hyper-synthetic`: x and I are drawn from N(0, 1); h: m2 → hidden → hidden → m1 with sigmoid
hidden layers, softmax on top (so that the target stays bounded) and He-uniform weights, zero
biases (the paper's appendix, Type I). Its text copy lacks the sizes; ours are the defaults below.

`rotate-digits`: scikit-learn's 8×8 digits, pixels /16 then standardised with the training
images' mean and std; images are split into train and test *before* rotating, each image
appears with `rotations_per_image` fresh angles. The angle is uniform in [0°, 360°) and the
label is the circularly nearest multiple of 30° (so 350° is class 0; the authors' code picks
from 0°..330° without wrap-around, putting [345°, 360°) in class 11). Rotation is bilinear
with zero fill (torch grid_sample); the authors rotated MNIST/CIFAR with PIL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from ._exceptions import HyperConfigError

__all__ = [
    "DATASET_NAMES",
    "ROTATION_CLASSES",
    "HyperDataset",
    "angle_to_class",
    "hyper_synthetic",
    "make_hyper_dataset",
    "rotate_digits",
    "rotate_images",
]

Task = Literal["regression", "classification"]
DATASET_NAMES = ("hyper-synthetic", "rotate-digits")
ROTATION_CLASSES = 12
_DEGREES_PER_CLASS = 360.0 / ROTATION_CLASSES


@dataclass(frozen=True)
class HyperDataset:
    """Train and test triples. x [N, input_dim], condition [N, condition_dim] float32;
    y [N, 1] float32 (regression) or [N] int64 class ids (classification)."""

    name: str
    task: Task
    x_train: torch.Tensor
    condition_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    condition_test: torch.Tensor
    y_test: torch.Tensor
    output_dim: int

    @property
    def input_dim(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def condition_dim(self) -> int:
        return int(self.condition_train.shape[1])


def hyper_synthetic(
    num_train: int = 10_000,
    num_test: int = 2_000,
    input_dim: int = 16,
    condition_dim: int = 16,
    hidden: int = 32,
    logit_scale: float = 1.0,
    seed: int = 0,
) -> HyperDataset:
    """y = <x, h(I)> with a fresh random h per `seed` (see the module docstring).

    `logit_scale` multiplies h's last layer before the softmax. At 1 (the paper's recipe)
    h(I) is close to uniform for every I, so ~99% of y's variance is <x, mean h>, a function
    of x alone; larger scales make the condition matter (see `benchmarks/seed001_hyper.py`).
    """
    for option, value in (("num_train", num_train), ("num_test", num_test),
                          ("input_dim", input_dim), ("condition_dim", condition_dim),
                          ("hidden", hidden)):
        if value < 1:
            raise HyperConfigError(f"must be >= 1, got {value}", option=option)
    gen = torch.Generator().manual_seed(seed)
    widths = (condition_dim, hidden, hidden, input_dim)
    # He uniform: U(-b, b), b = sqrt(6 / fan_in).
    weights = [
        (torch.rand(fan_out, fan_in, generator=gen) * 2 - 1) * math.sqrt(6.0 / fan_in)
        for fan_in, fan_out in zip(widths[:-1], widths[1:], strict=True)
    ]

    def target(x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        hidden_act = cond
        for w in weights[:-1]:
            hidden_act = torch.sigmoid(hidden_act @ w.T)
        h = torch.softmax(logit_scale * (hidden_act @ weights[-1].T), dim=1)
        return (x * h).sum(dim=1, keepdim=True)

    total = num_train + num_test
    x = torch.randn(total, input_dim, generator=gen)
    cond = torch.randn(total, condition_dim, generator=gen)
    y = target(x, cond)
    return HyperDataset(
        name="hyper-synthetic", task="regression",
        x_train=x[:num_train], condition_train=cond[:num_train], y_train=y[:num_train],
        x_test=x[num_train:], condition_test=cond[num_train:], y_test=y[num_train:],
        output_dim=1,
    )


def angle_to_class(degrees: torch.Tensor) -> torch.Tensor:
    """The circularly nearest multiple of 30°, as a class id 0..11 (int64)."""
    return torch.round(degrees / _DEGREES_PER_CLASS).long() % ROTATION_CLASSES


def rotate_images(images: torch.Tensor, degrees: torch.Tensor) -> torch.Tensor:
    """Each image [N, H, W] rotated about its centre by its angle, bilinear, zero fill.

    A positive angle turns the picture counter-clockwise as displayed (row 0 on top), so
    90° equals `torch.rot90(image, 1, (0, 1))`.
    """
    radians = degrees.to(torch.float64) * (math.pi / 180.0)
    cos, sin = torch.cos(radians), torch.sin(radians)
    zero = torch.zeros_like(cos)
    # grid_sample reads output pixel (u, v) from input (cos·u − sin·v, sin·u + cos·v) in
    # normalised (x right, y down) coordinates: a counter-clockwise turn on screen.
    affine = torch.stack(
        [torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1
    ).to(images.dtype)
    batch = images.unsqueeze(1)
    grid = F.affine_grid(affine, list(batch.shape), align_corners=False)
    out = F.grid_sample(batch, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.squeeze(1)


def rotate_digits(
    rotations_per_image: int = 8,
    test_fraction: float = 0.25,
    seed: int = 0,
) -> HyperDataset:
    """scikit-learn digits (d = 64): x rotated, condition upright, y the 30° class."""
    from sklearn.datasets import load_digits

    if rotations_per_image < 1:
        raise HyperConfigError(f"must be >= 1, got {rotations_per_image}",
                               option="rotations_per_image")
    if not 0.0 < test_fraction < 1.0:
        raise HyperConfigError(f"must be in (0, 1), got {test_fraction}", option="test_fraction")
    images = np.asarray(load_digits().images, dtype=np.float32) / 16.0
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(images))
    num_test = max(1, round(len(images) * test_fraction))
    test_idx, train_idx = order[:num_test], order[num_test:]
    mean = float(images[train_idx].mean())
    std = float(images[train_idx].std())
    gen = torch.Generator().manual_seed(seed)

    def triples(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        upright = torch.from_numpy(np.repeat(images[idx], rotations_per_image, axis=0))
        degrees = torch.rand(len(upright), generator=gen, dtype=torch.float64) * 360.0
        rotated = rotate_images(upright, degrees)
        flat = upright.shape[0], -1
        x = ((rotated - mean) / std).reshape(flat)
        cond = ((upright - mean) / std).reshape(flat)
        return x.contiguous(), cond.contiguous(), angle_to_class(degrees)

    x_train, c_train, y_train = triples(train_idx)
    x_test, c_test, y_test = triples(test_idx)
    return HyperDataset(
        name="rotate-digits", task="classification",
        x_train=x_train, condition_train=c_train, y_train=y_train,
        x_test=x_test, condition_test=c_test, y_test=y_test,
        output_dim=ROTATION_CLASSES,
    )


def make_hyper_dataset(name: str, seed: int = 0) -> HyperDataset:
    """A dataset by its `momlp build --dataset` name, with default sizes."""
    if name == "hyper-synthetic":
        return hyper_synthetic(seed=seed)
    if name == "rotate-digits":
        return rotate_digits(seed=seed)
    raise HyperConfigError(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}",
                           option="dataset")
