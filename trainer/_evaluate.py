"""Score the mixture exactly as the server will serve it: the saved router, the saved files.

Nothing trained in memory is used: the router is read back from its safetensors file, each
test row is routed with the store's routing mode (top-1), and each expert is loaded from its
file (checksum verified) one at a time, so the figure in report.json is the served model's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from ._datasets import Task
from ._tasks import score_outputs
from ._train import predict

__all__ = ["ExpertFileRef", "MixtureScore", "evaluate_mixture", "mixture_outputs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertFileRef:
    path: Path
    sha256: str


@dataclass(frozen=True)
class MixtureScore:
    metric: str  # "mse" | "accuracy"
    value: float
    test_samples: list[int]  # test rows routed to each expert
    # The metric over each expert's own test rows (None where none were routed to it): which
    # cells carry a mixture's error.
    by_expert: list[float | None]
    seconds: float


def mixture_outputs(
    router_path: Path,
    routing: str,
    experts: Mapping[int, ExpertFileRef],
    x: npt.NDArray[np.float32],
    output_dim: int,
    *,
    lift: str | None = None,
    store_root: Path | None = None,
) -> tuple[Tensor, Tensor]:
    """(outputs [B, out], expert ids [B]) of the mixture read back from files; with
    lift="linear" rows are lifted before routing, as the server does. `store_root`: the
    store the files belong to; an expert file a link leads out of it is refused unread
    (ExpertFormatError), as the server refuses it."""
    from experts_store import load_expert
    from router import PrototypeTree, lift_rows

    tree = PrototypeTree.load(router_path)
    xt = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    xr = lift_rows(xt) if lift == "linear" else xt
    chosen = tree.route(xr, mode="exact" if routing == "exact" else "tree", top_k=1).experts[:, 0]
    outputs = torch.zeros(xt.shape[0], output_dim, dtype=torch.float32)
    for expert_id in torch.unique(chosen).tolist():
        rows = torch.nonzero(chosen == expert_id).squeeze(1)
        ref = experts[int(expert_id)]
        # One expert resident at a time, as a server with a one-expert budget would do.
        expert = load_expert(
            ref.path, expected_sha256=ref.sha256, expert_id=int(expert_id),
            store_root=None if store_root is None else str(store_root),
        )
        outputs[rows] = predict(expert, xt[rows])
        del expert
    return outputs, chosen


def evaluate_mixture(
    router_path: Path,
    routing: str,
    experts: Mapping[int, ExpertFileRef],
    x_test: npt.NDArray[np.float32],
    y_test: npt.NDArray[np.generic],
    task: Task,
    output_dim: int,
    *,
    lift: str | None = None,
    store_root: Path | None = None,
) -> MixtureScore:
    """The mixture's metric on the test rows, read back from files as `mixture_outputs`
    reads them."""
    start = time.perf_counter()
    outputs, chosen = mixture_outputs(
        router_path, routing, experts, x_test, output_dim, lift=lift, store_root=store_root
    )
    dtype = torch.int64 if task == "classification" else torch.float32
    targets = torch.as_tensor(np.asarray(y_test), dtype=dtype)
    value = score_outputs(task, outputs, targets)
    counts = torch.bincount(chosen, minlength=len(experts)).tolist()
    by_expert: list[float | None] = []
    for expert_id, count in enumerate(counts):
        own = chosen == expert_id
        by_expert.append(score_outputs(task, outputs[own], targets[own]) if count else None)
    return MixtureScore(
        metric="accuracy" if task == "classification" else "mse",
        value=value,
        test_samples=[int(c) for c in counts],
        by_expert=by_expert,
        seconds=time.perf_counter() - start,
    )
