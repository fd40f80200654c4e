"""A user's (X, I, y) triples for `momlp build --kind hyper --data FILE.npz`, read and checked
before any training: a file that cannot be trained on is a `HyperConfigError` naming it.

    data = load_npz_triples(Path("triples.npz"), test_fraction=0.2, seed=0)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from experts_store import file_problem

from .._arrays import (
    UNREADABLE_ARRAY_FILE,
    class_count_problem,
    number_problem,
    open_regular,
    unreadable_reason,
)
from ._data import HyperDataset
from ._exceptions import HyperConfigError

__all__ = ["MAX_SEED", "check_split_options", "load_npz_triples", "read_npz"]

# numpy takes any non-negative seed, torch.manual_seed at most 2**64 - 1 (beyond: a traceback).
MAX_SEED = 2**64 - 1


def check_split_options(test_fraction: float, seed: int) -> None:
    """Refuse a test fraction outside (0, 1) and a seed numpy or torch cannot take."""
    if not 0.0 < test_fraction < 1.0:
        raise HyperConfigError(f"must lie in (0, 1), got {test_fraction}", option="test_fraction")
    if not 0 <= seed <= MAX_SEED:
        raise HyperConfigError(f"must be in [0, {MAX_SEED}], got {seed}", option="seed")


def read_npz(path: Path, names: Sequence[str] | None = None) -> dict[str, npt.NDArray[np.generic]]:
    """The arrays `names` (all of them when None) of the .npz at `path`, never unpickling."""
    problem = file_problem(path)
    if problem is not None:
        # Said as it is, not as an archive numpy could not parse.
        raise HyperConfigError(f"{path}: {problem}", option="data")
    try:
        # Opened here, not by np.load: numpy leaves its own handle open on a damaged zip.
        with open_regular(path) as handle:
            loaded = np.load(handle, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise HyperConfigError(f"{path}: holds one array, not an .npz archive",
                                       option="data")
            with loaded as npz:
                return _members(path, npz, list(npz.files) if names is None else list(names))
    except UNREADABLE_ARRAY_FILE as exc:
        raise HyperConfigError(f"{path}: cannot read the archive: {unreadable_reason(exc)}",
                               option="data") from exc


def _members(
    path: Path, npz: np.lib.npyio.NpzFile, names: list[str]
) -> dict[str, npt.NDArray[np.generic]]:
    missing = [name for name in names if name not in npz.files]
    if missing:
        listed = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise HyperConfigError(
            f"{path}: need an .npz with {listed}; it lacks {', '.join(missing)} "
            f"(has {', '.join(npz.files) or 'nothing'})", option="data",
        )
    arrays: dict[str, npt.NDArray[np.generic]] = {}
    for name in names:
        value = npz[name]
        # A member whose bytes lack the .npy header comes back as raw bytes.
        if not isinstance(value, np.ndarray):
            raise HyperConfigError(f"{path}: member {name} is not an .npy array", option="data")
        arrays[name] = value
    return arrays


def _check_numbers(path: Path, name: str, values: npt.NDArray[np.generic]) -> None:
    problem = number_problem(name, values)
    if problem is not None:
        raise HyperConfigError(f"{path}: {problem}", option="data")


def _labels(path: Path, y: npt.NDArray[np.generic], rows: int) -> torch.Tensor:
    """Integer y: one class label per row, [N] or [N, 1], labels 0..C-1 with C >= 2."""
    if not (y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)):
        raise HyperConfigError(
            f"{path}: integer y holds class labels, one per row: need y [{rows}] or "
            f"[{rows}, 1], got {list(y.shape)} (float y for regression)", option="data",
        )
    labels = y.reshape(-1)
    if int(labels.min()) < 0:
        raise HyperConfigError(
            f"{path}: class labels must be >= 0, got {int(labels.min())} "
            f"(first: row {int(np.argmin(labels))})", option="data",
        )
    problem = class_count_problem("y", labels)
    if problem is not None:
        raise HyperConfigError(f"{path}: {problem}", option="data")
    distinct = np.unique(labels)
    if distinct.size < 2:
        raise HyperConfigError(
            f"{path}: classification needs at least 2 classes, y holds only {distinct.tolist()}",
            option="data",
        )
    return torch.from_numpy(labels.astype(np.int64))


def load_npz_triples(path: Path, test_fraction: float, seed: int) -> HyperDataset:
    """An .npz with X [N, m1], I [N, m2] and y [N] or [N, out] (integer y: class labels [N]),
    split at random into train and test rows."""
    check_split_options(test_fraction, seed)
    arrays = read_npz(path, ("X", "I", "y"))
    x, cond, y = arrays["X"], arrays["I"], arrays["y"]
    n = x.shape[0] if x.ndim else 0
    if (x.ndim != 2 or cond.ndim != 2 or y.ndim == 0 or cond.shape[0] != n or y.shape[0] != n
            or n < 2):
        raise HyperConfigError(
            f"{path}: X {list(x.shape)}, I {list(cond.shape)}, y {list(y.shape)} do not line up",
            option="data",
        )
    if x.shape[1] == 0 or cond.shape[1] == 0:
        raise HyperConfigError(
            f"{path}: X and I need at least one column, got X {list(x.shape)}, "
            f"I {list(cond.shape)}", option="data",
        )
    for name, values in arrays.items():
        _check_numbers(path, name, values)
    classification = y.dtype.kind in "iu"
    if classification:
        yt = _labels(path, y, n)
        output_dim = int(yt.max()) + 1
    else:
        if y.ndim > 2 or (y.ndim == 2 and y.shape[1] == 0):
            raise HyperConfigError(
                f"{path}: regression y must be [{n}] or [{n}, out] with out >= 1, "
                f"got {list(y.shape)}", option="data",
            )
        yt = torch.from_numpy(y.astype(np.float32).reshape(n, -1))
        output_dim = int(yt.shape[1])
    num_test = max(1, round(n * test_fraction))
    if num_test >= n:
        raise HyperConfigError(
            f"{path}: {n} rows leave no training rows at test_fraction {test_fraction}",
            option="data",
        )
    order = np.random.default_rng(seed).permutation(n)
    test, train = order[:num_test], order[num_test:]
    xt, ct = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(cond.astype(np.float32))
    return HyperDataset(
        name=path.name, task="classification" if classification else "regression",
        x_train=xt[train], condition_train=ct[train], y_train=yt[train],
        x_test=xt[test], condition_test=ct[test], y_test=yt[test], output_dim=output_dim,
    )
