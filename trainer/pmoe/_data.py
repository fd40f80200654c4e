"""`digits-patches`: paper 003's synthetic MNIST task (Sec. 5.1) rebuilt from scikit-learn digits.

Each sample is a grid (4x4 by default) of 8x8 digit images, i.e. n = 16 patches of d = 64
pixels scaled to [0, 1]. Exactly one patch shows a class-discriminative digit (by default "0"
or "1"; the class is its position in `discriminative`), at a uniformly random grid position;
every other patch is a class-irrelevant digit (by default 2-9). The source images of every
digit are split into train and test before any sample is composed, so no image appears on both
sides; within a side images are drawn with replacement.

    data = digits_patches(num_train=1000, num_test=1000, seed=0)
    data.x_train          # float32 [N, 16, 64]
    data.position_train   # int64 [N], the discriminative patch's index
    data.subset(300)      # the first 300 training samples, balanced over the classes
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from ._exceptions import PMoEConfigError

__all__ = [
    "DIGITS_PATCH_SHAPE",
    "PatchDataset",
    "digits_patches",
    "image_to_patches",
    "patches_to_image",
]

DIGITS_PATCH_SHAPE = (8, 8)
_DIGITS_MAX = 16.0  # sklearn digits hold integer intensities 0..16

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class PatchDataset:
    """A train/test split of patch samples with where each one's discriminative patch is.

    `source_*` [N, n] give, for every patch, the row of `sklearn.datasets.load_digits()` it
    was cut from; `classes` name the discriminative digits in class-index order.
    """

    name: str
    x_train: FloatArray
    y_train: IntArray
    position_train: IntArray
    source_train: IntArray
    x_test: FloatArray
    y_test: IntArray
    position_test: IntArray
    source_test: IntArray
    classes: tuple[str, ...]
    grid: tuple[int, int]
    patch_shape: tuple[int, int]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def num_patches(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def patch_dim(self) -> int:
        return int(self.x_train.shape[2])

    def subset(self, num_train: int) -> PatchDataset:
        """The first `num_train` training samples (balanced: classes cycle along the rows)."""
        if not 1 <= num_train <= len(self.y_train):
            raise PMoEConfigError(
                f"must be in 1..{len(self.y_train)}, got {num_train}", option="num_train"
            )
        return replace(
            self,
            x_train=self.x_train[:num_train],
            y_train=self.y_train[:num_train],
            position_train=self.position_train[:num_train],
            source_train=self.source_train[:num_train],
        )


def _split_sources(
    target: IntArray, digits: tuple[int, ...], test_fraction: float, rng: np.random.Generator
) -> tuple[dict[int, IntArray], dict[int, IntArray]]:
    train: dict[int, IntArray] = {}
    test: dict[int, IntArray] = {}
    for digit in digits:
        rows = rng.permutation(np.flatnonzero(target == digit)).astype(np.int64)
        cut = int(round(len(rows) * test_fraction))
        test[digit], train[digit] = rows[:cut], rows[cut:]
    return train, test


def _compose(
    count: int,
    pools: dict[int, IntArray],
    discriminative: tuple[int, ...],
    irrelevant: tuple[int, ...],
    num_patches: int,
    rng: np.random.Generator,
) -> tuple[IntArray, IntArray, IntArray]:
    # Labels cycle 0, 1, ..., c-1 so that every prefix is balanced (`PatchDataset.subset`).
    labels = np.arange(count, dtype=np.int64) % len(discriminative)
    positions = rng.integers(0, num_patches, size=count).astype(np.int64)
    irrelevant_pool = np.concatenate([pools[d] for d in irrelevant])
    sources = irrelevant_pool[rng.integers(0, len(irrelevant_pool), size=(count, num_patches))]
    for label, digit in enumerate(discriminative):
        rows = np.flatnonzero(labels == label)
        pool = pools[digit]
        sources[rows, positions[rows]] = pool[rng.integers(0, len(pool), size=len(rows))]
    return labels, positions, sources.astype(np.int64)


def digits_patches(
    *,
    num_train: int = 1000,
    num_test: int = 1000,
    discriminative: tuple[int, ...] = (0, 1),
    irrelevant: tuple[int, ...] | None = None,
    grid: tuple[int, int] = (4, 4),
    test_fraction: float = 0.3,
    seed: int = 0,
) -> PatchDataset:
    """Compose the dataset; `irrelevant` defaults to every digit not in `discriminative`.

    The class of a sample is the index in `discriminative` of its discriminative digit: with
    the default (0, 1), class 1 is the paper's y = +1 (digit "1"), class 0 its y = -1.
    """
    from sklearn.datasets import load_digits

    if irrelevant is None:
        irrelevant = tuple(d for d in range(10) if d not in discriminative)
    if len(discriminative) < 2 or len(set(discriminative)) != len(discriminative):
        raise PMoEConfigError("needs two or more distinct digits", option="discriminative")
    if set(discriminative) & set(irrelevant) or not irrelevant:
        raise PMoEConfigError(
            "must be non-empty and share no digit with discriminative", option="irrelevant"
        )
    if not set(discriminative) | set(irrelevant) <= set(range(10)):
        raise PMoEConfigError("digits are 0..9", option="discriminative")
    if not 0.0 < test_fraction < 1.0:
        raise PMoEConfigError(f"must be in (0, 1), got {test_fraction}", option="test_fraction")
    if num_train < 1 or num_test < 1:
        raise PMoEConfigError("need at least one sample on each side", option="num_train")
    digits = load_digits()
    images = np.asarray(digits.images, dtype=np.float32).reshape(len(digits.images), -1)
    images /= _DIGITS_MAX
    target = np.asarray(digits.target, dtype=np.int64)
    rng = np.random.default_rng(seed)
    train_pools, test_pools = _split_sources(
        target, tuple(discriminative) + tuple(irrelevant), test_fraction, rng
    )
    num_patches = grid[0] * grid[1]
    y_train, pos_train, src_train = _compose(
        num_train, train_pools, discriminative, irrelevant, num_patches, rng
    )
    y_test, pos_test, src_test = _compose(
        num_test, test_pools, discriminative, irrelevant, num_patches, rng
    )
    suffix = "" if len(discriminative) == 2 else f"-{len(discriminative)}class"
    return PatchDataset(
        name=f"digits-patches{suffix}",
        x_train=images[src_train],
        y_train=y_train,
        position_train=pos_train,
        source_train=src_train,
        x_test=images[src_test],
        y_test=y_test,
        position_test=pos_test,
        source_test=src_test,
        classes=tuple(str(d) for d in discriminative),
        grid=grid,
        patch_shape=DIGITS_PATCH_SHAPE,
    )


def image_to_patches(images: FloatArray, patch_shape: tuple[int, int]) -> FloatArray:
    """Cut [B, H, W, C] images into non-overlapping patches, row-major: [B, n, ph*pw*C]."""
    b, h, w, c = images.shape
    ph, pw = patch_shape
    if h % ph or w % pw:
        raise PMoEConfigError(
            f"{h}x{w} images do not split into {ph}x{pw} patches", option="patch_shape"
        )
    grid = images.reshape(b, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 2, 4, 5)
    return np.ascontiguousarray(grid.reshape(b, (h // ph) * (w // pw), ph * pw * c))


def patches_to_image(
    patches: FloatArray, grid: tuple[int, int], patch_shape: tuple[int, int]
) -> FloatArray:
    """The inverse of `image_to_patches`: [B, n, ph*pw*C] -> [B, H, W, C]."""
    b, n, dim = patches.shape
    ph, pw = patch_shape
    c = dim // (ph * pw)
    rows, cols = grid
    blocks = patches.reshape(b, rows, cols, ph, pw, c).transpose(0, 1, 3, 2, 4, 5)
    return np.ascontiguousarray(blocks.reshape(b, rows * ph, cols * pw, c))
