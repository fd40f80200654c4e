"""The paper's datasets (Section 6.1, Appendix C and D.1) and sklearn's digits, by name: the
target functions sampled on a regular grid, or an fBm path, checked and split like any
other rows (`trainer._rows`)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from ._exceptions import DataError
from ._rows import Dataset, FloatArray, classification_rows, regression_rows, split

__all__ = [
    "DATASET_NAMES",
    "DEFAULT_HURST",
    "ackley",
    "fbm_path",
    "make_dataset",
    "rastrigin",
    "regular_grid",
]

DATASET_NAMES = ("holder1d", "ackley2d", "ackley3d", "rastrigin2d", "rastrigin3d", "digits")

# Section 6.1: s^n grid vertices, s = 10,000 (n=1), 150 (n=2), 30 (n=3).
_PAPER_GRID_SIZE = {1: 10_000, 2: 150, 3: 30}
DEFAULT_HURST = 0.25


def ackley(x: npt.ArrayLike, a: float = 20.0, b: float = 0.2) -> FloatArray:
    """Eq. (37): 20 + e − a·exp(−b·sqrt(mean x²)) − exp(mean cos 2πx), over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    root_mean_square = np.sqrt(np.mean(x**2, axis=-1))
    mean_cos = np.mean(np.cos(2.0 * math.pi * x), axis=-1)
    return np.asarray(
        20.0 + math.e - a * np.exp(-b * root_mean_square) - np.exp(mean_cos), dtype=np.float64
    )


def rastrigin(x: npt.ArrayLike) -> FloatArray:
    """Eq. (38): Σ x² + 10 (n − Σ cos 2πx), over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    return np.asarray(
        np.sum(x**2, axis=-1) + 10.0 * (n - np.sum(np.cos(2.0 * math.pi * x), axis=-1)),
        dtype=np.float64,
    )


def regular_grid(points_per_axis: int, dim: int, low: float, high: float) -> FloatArray:
    """The s^n vertices of the regular grid on [low, high]^n, as rows [s^n, n]."""
    axis = np.linspace(low, high, points_per_axis)
    mesh = np.meshgrid(*([axis] * dim), indexing="ij")
    return np.stack([m.reshape(-1) for m in mesh], axis=1)


def fbm_path(num_points: int, hurst: float, rng: np.random.Generator) -> FloatArray:
    """Fractional Brownian motion B_H on the grid t_k = k/(num_points−1) of [0, 1], B_H(0) = 0.

    Exact in distribution (Davies-Harte circulant embedding of fractional Gaussian noise):
    Cov(B_H(t), B_H(u)) = (t^{2H} + u^{2H} − |t−u|^{2H}) / 2.
    """
    if not 0.0 < hurst < 1.0:
        raise ValueError(f"hurst must lie in (0, 1), got {hurst}")
    if num_points < 2:
        raise ValueError("an fBm path needs at least 2 points")
    steps = num_points - 1
    k = np.arange(steps + 1, dtype=np.float64)
    two_h = 2.0 * hurst
    autocov = 0.5 * (np.abs(k + 1) ** two_h - 2.0 * k**two_h + np.abs(k - 1) ** two_h)
    # First row of the 2m-circulant matrix embedding the Toeplitz covariance of m increments.
    row = np.concatenate([autocov, autocov[-2:0:-1]])
    eigenvalues = np.fft.fft(row).real
    # fGn's embedding is non-negative definite for every H; clip only round-off.
    eigenvalues = np.clip(eigenvalues, 0.0, None)
    size = row.shape[0]
    noise = rng.standard_normal(size) + 1j * rng.standard_normal(size)
    increments = np.fft.fft(np.sqrt(eigenvalues / size) * noise).real[:steps]
    # Unit-step fGn scaled to step 1/steps (self-similarity).
    increments *= steps ** (-hurst)
    return np.concatenate([[0.0], np.cumsum(increments)])


def make_dataset(
    name: str,
    *,
    seed: int = 0,
    grid_size: int | None = None,
    hurst: float = DEFAULT_HURST,
    test_fraction: float = 0.2,
) -> Dataset:
    """One of DATASET_NAMES; grid_size overrides the paper's s (per axis) for small runs."""
    rng = np.random.default_rng(seed)
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        # Pixel intensities are 0..16; scale to [0, 1] so distances to prototypes are tame.
        x = np.asarray(digits.data, dtype=np.float64) / 16.0
        labels = np.asarray(digits.target, dtype=np.int64)
        classes = [str(c) for c in range(10)]
        return split(classification_rows(name, x, labels, classes), rng, test_fraction)
    if name not in DATASET_NAMES:
        raise DataError(
            f"unknown dataset; choose one of {', '.join(DATASET_NAMES)}", source=name
        )
    dim = int(name[-2])
    s = grid_size if grid_size is not None else _PAPER_GRID_SIZE[dim]
    if s < 2:
        raise DataError(f"grid size must be at least 2, got {s}", source=name)
    if name == "holder1d":
        x = regular_grid(s, 1, 0.0, 1.0)
        y = fbm_path(s, hurst, rng)
    else:
        x = regular_grid(s, dim, -1.0, 1.0)
        y = ackley(x) if name.startswith("ackley") else rastrigin(x)
    return split(regression_rows(name, x, y.reshape(-1, 1)), rng, test_fraction)

