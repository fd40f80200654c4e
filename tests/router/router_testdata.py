"""Data makers and an independent numpy reference shared by the router tests."""

from __future__ import annotations

import numpy as np


def numpy_knn(x: np.ndarray, p: np.ndarray, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """k nearest by float64 direct differences, ties to the lowest index: (idx, sq dists)."""
    x64 = np.asarray(x, dtype=np.float64)
    p64 = np.asarray(p, dtype=np.float32).astype(np.float64)
    d2 = ((x64[:, None, :] - p64[None, :, :]) ** 2).sum(axis=2)
    idx = np.argsort(d2, axis=1, kind="stable")[:, :k]
    return idx, np.take_along_axis(d2, idx, axis=1)


def make_prototypes(kind: str, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """uniform | clustered | lowdim (a curve in R^n) | duplicates; float32 [k, n]."""
    if kind == "uniform":
        p = rng.random((k, n))
    elif kind == "clustered":
        centres = rng.random((max(1, k // 20), n))
        p = centres[rng.integers(0, len(centres), k)] + 0.01 * rng.standard_normal((k, n))
    elif kind == "lowdim":
        t = rng.random((k, 1))
        direction = rng.standard_normal((1, n))
        p = t * direction + 0.1 * np.sin(7 * t) * rng.standard_normal((1, n))
    elif kind == "duplicates":
        base = rng.random((max(1, k // 3), n))
        p = base[rng.integers(0, len(base), k)]
    else:
        raise ValueError(kind)
    return p.astype(np.float32)


def duplicate_each(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Every row of p twice, in a random order: each query's nearest is a tied pair."""
    both = np.concatenate([p, p])
    return both[rng.permutation(len(both))]


def make_queries(p: np.ndarray, b: int, rng: np.random.Generator) -> np.ndarray:
    """Random points, the prototypes themselves and midpoints of prototype pairs (ties)."""
    k, n = p.shape
    lo, hi = p.min(axis=0), p.max(axis=0)
    span = np.maximum(hi - lo, 1e-3)
    free = lo - 0.2 * span + 1.4 * span * rng.random((b, n))
    own = p[rng.integers(0, k, b)].astype(np.float64)
    i, j = rng.integers(0, k, b), rng.integers(0, k, b)
    mid = (p[i].astype(np.float64) + p[j].astype(np.float64)) / 2
    return np.concatenate([free, own, mid])
