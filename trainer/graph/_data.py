"""The .npz a graph build reads (`momlp build --kind graph --data FILE.npz`), read and checked
before any training: a file that cannot be trained on is a `DataError` naming it.

    x, y, targets = read_graph_npz(Path("data.npz"))   # X [N, n], y [N, out], t_<node>
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from .._arrays import UNREADABLE_ARRAY_FILE, number_problem, open_regular, unreadable_reason
from .._exceptions import DataError

__all__ = ["TARGET_PREFIX", "read_graph_npz"]

TARGET_PREFIX = "t_"  # .npz arrays "t_<node>": that node's observed target (nodewise)
Array = npt.NDArray[np.generic]


def read_graph_npz(path: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """X [N, n] (N >= 1), y [N] or [N, out] and every t_<node> [N] or [N, out_v], as float32
    tensors with y and the targets 2-D; DataError naming the file for anything else."""
    source = str(path)
    if not path.is_file() or path.suffix.lower() != ".npz":
        raise DataError("graph builds read an .npz (X, y, optional t_<node>)", source=source)
    arrays = _read_members(path, source)
    x = arrays["X"]
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise DataError(f"X must be 2-D [rows, features] with at least one of each, got shape "
                        f"{list(x.shape)}", source=source)
    for name, values in arrays.items():
        if name == "X":
            continue
        if values.ndim not in (1, 2) or values.shape[0] != x.shape[0]:
            raise DataError(f"{name} must be [{x.shape[0]}] or [{x.shape[0]}, columns], one row "
                            f"per row of X; got shape {list(values.shape)}", source=source)
    for name, values in arrays.items():
        _check_numbers(source, name, values)
    tensors = {name: torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
               for name, values in arrays.items()}
    y = tensors.pop("y").reshape(x.shape[0], -1)
    features = tensors.pop("X")
    targets = {name[len(TARGET_PREFIX):]: t.reshape(x.shape[0], -1) for name, t in tensors.items()}
    return features, y, targets


def _read_members(path: Path, source: str) -> dict[str, Array]:
    """X, y and the t_<node> members, never unpickling; other members are not read."""
    try:
        # The file opened here, not by np.load: numpy leaves its own handle open when the
        # zip is damaged.
        with open_regular(path) as handle:
            loaded = np.load(handle, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise DataError("holds one array (np.save), not an .npz archive (np.savez)",
                                source=source)
            with loaded as archive:
                names = archive.files
                missing = [name for name in ("X", "y") if name not in names]
                if missing:
                    raise DataError(f"the archive needs arrays X and y; it lacks {missing} "
                                    f"(has {names})", source=source)
                wanted = ["X", "y", *(n for n in names if n.startswith(TARGET_PREFIX))]
                arrays = {name: archive[name] for name in wanted}
    except UNREADABLE_ARRAY_FILE as exc:
        raise DataError(f"cannot read the archive: {unreadable_reason(exc)}",
                        source=source) from exc
    for name, value in arrays.items():
        # numpy hands back a member without the .npy header as its raw bytes.
        if not isinstance(value, np.ndarray):
            raise DataError(f"member {name} is not an .npy array", source=source)
    return arrays


def _check_numbers(source: str, name: str, values: Array) -> None:
    problem = number_problem(name, values)
    if problem is not None:
        raise DataError(problem, source=source)
