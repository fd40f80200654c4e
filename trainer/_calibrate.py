"""A store's gate temperature, chosen from data: the τ whose top-k mixtures fit held-out rows.

The served top-k gate is softmax(-score/τ) over the k nearest prototypes. The right τ depends
on the scale of the prototype distances (d² ≈ 0.01 on a 16-expert 2-D store, so τ = 1 averages
neighbours flatly). `fit_temperature` computes each held-out row's k nearest experts' outputs
once, then scans τ on a log grid around the median nearest score (20 points a decade) and
scores each τ by the mean per-row loss over the top-k gates asked for (MSE, or cross-entropy
for classification).

The τ kept is the smallest one whose loss is within one standard error of the best τ's (the
one-standard-error rule; Breiman et al. 1984, Hastie et al. ESL §7.10), the standard error
being that of the per-row paired difference to the best τ. Why not the plain minimum: the
gain of mixing is a few per cent of the loss, and per-row squared errors are heavy-tailed (on
the Ackley-2D quick store the worst 1 % of the 320 held-out rows carry 21 % of the loss), so
on a small held-out split the minimum's gain is within noise (−4.0 % ± 5.4 % there) and its
position is mostly noise too: it sat at 2× the τ fitted on 2,000 fresh points, where top-2
and top-3 were 10 % / 23 % worse than top-1. τ → 0 is the hard gate the experts were trained
for, so the rule moves away from it only as far as the held-out rows support; with plenty of
rows (the standard error shrinks as 1/√rows) it tends to the minimum.

In tree routing a calibrated store's top-k is the soft tree walk (`tree_top_k="beam"`): as
τ → 0 it becomes the top-1 tree expert the experts were trained for, so on the fitting rows
the chosen τ's top-k loss is at most (about) top-1's. The exact nearest-k is not: about 9% of
Ackley rows have an exact nearest prototype other than their tree leaf.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._exceptions import DataError

__all__ = ["TemperatureFit", "calibrate_store", "fit_temperature"]

# The gates fitted for when none are named: top-2 and top-3 (those a store of K experts has).
DEFAULT_TOP_KS = (2, 3)

logger = logging.getLogger(__name__)

# τ grid: median nearest score × 10^[-3, 3], 20 points a decade (a step of 12 %: finer than
# the loss curve's features, and the rule below, not the step, limits the precision).
_GRID_DECADES = 3.0
_GRID_POINTS = 121


@dataclass(frozen=True)
class TemperatureFit:
    temperature: float
    calibration: dict[str, Any]  # the manifest gate block's `calibration`: how τ was chosen


def fit_temperature(
    tree: Any,
    expert_forward: Callable[[int, torch.Tensor], torch.Tensor],
    x: npt.NDArray[np.floating[Any]],
    y: npt.NDArray[Any],
    task: str,
    *,
    top_ks: Sequence[int] | None = None,
    score: str = "sqdist",
    mode: str = "tree",
    tree_top_k: str = "beam",
    source: str = "held-out rows",
) -> TemperatureFit:
    """Fit τ of the top-k gate of `tree` (a router.PrototypeTree) on rows (x, y).

    The gates scored are exactly the served ones (`router.Gate(top_k=k, mode, score,
    tree_top_k)` through `tree.gate`). expert_forward(expert_id, rows [m, n] float32) ->
    outputs [m, out], called once per expert for the rows some gate needs. Targets y:
    [N, out] floats (regression) or [N] class indices (classification).
    """
    from router import Gate

    if top_ks is None:
        # The default: the top-2 and top-3 mixtures, those a store of K experts has.
        top_ks = [k for k in DEFAULT_TOP_KS if k <= tree.num_prototypes]
    outside = sorted({k for k in top_ks if not 2 <= k <= tree.num_prototypes})
    if outside or not top_ks:
        # Top-1 has no τ to fit, and a k beyond K would be served as K: asked for, it is an
        # error, not dropped.
        raise DataError(f"top_k must lie in 2..{tree.num_prototypes} (the store's K), got "
                        f"{outside or 'none'}", source=source)
    ks = sorted(set(top_ks))
    if len(x) < 2:
        raise DataError("calibration needs at least 2 rows", source=source)
    xt = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    targets = torch.as_tensor(np.asarray(y))
    cache = _OutputCache(xt, expert_forward)

    def row_losses(tau: float, k: int) -> torch.Tensor:
        gate = Gate(top_k=k, mode=mode, temperature=tau, score=score,  # type: ignore[arg-type]
                    tree_top_k=tree_top_k)  # type: ignore[arg-type]
        return _row_losses(cache.mixture(tree.gate(xt, gate)), targets, task)

    def loss(tau: float, k: int) -> float:
        return float(row_losses(tau, k).mean())

    top1 = loss(1.0, 1)
    nearest = tree.gate(xt, Gate(top_k=2, mode="exact")).distances[:, 0].to(torch.float64)
    s = nearest if score == "dist" else nearest * nearest
    median = float(torch.median(s))
    scale = median if median > 0 else 1.0
    grid = scale * np.logspace(-_GRID_DECADES, _GRID_DECADES, _GRID_POINTS)
    # per_row[t, i]: row i's loss at grid[t], averaged over the top-k gates.
    per_row = torch.stack(
        [torch.stack([row_losses(float(tau), k) for k in ks]).mean(dim=0) for tau in grid]
    )
    means = per_row.mean(dim=1)
    best = int(torch.argmin(means))  # first minimum: the smallest τ of a tie
    rows = per_row.shape[1]
    # Standard error of each τ's mean loss minus the best's, from the paired per-row gaps.
    gaps = per_row - per_row[best]
    se = gaps.std(dim=1, correction=1) / math.sqrt(rows)
    chosen = int(torch.nonzero(means <= means[best] + se)[0, 0])
    tau = float(grid[chosen])
    top1_rows = row_losses(1.0, 1)
    gain = per_row[best] - top1_rows
    calibration: dict[str, Any] = {
        "method": "grid search over log τ of the mean held-out loss of the served top-k "
        "gates; the smallest τ within one standard error of the best (one-standard-error "
        "rule, paired per-row differences)",
        "data": source,
        "rows": len(x),
        "top_k": ks,
        "mode": mode,
        "tree_top_k": tree_top_k,
        "loss": "mse" if task == "regression" else "cross_entropy",
        "score": score,
        "median_nearest_score": median,
        "grid": {"low": float(grid[0]), "high": float(grid[-1]), "points": _GRID_POINTS},
        "loss_top1": top1,
        "best_temperature": float(grid[best]),
        "loss_at_best": float(means[best]),
        "standard_error_at_temperature": float(se[chosen]),
        # The best τ's gain over top-1 and its standard error: how well the rows resolve it.
        "gain_over_top1_at_best": float(gain.mean()),
        "gain_standard_error": float(gain.std(correction=1)) / math.sqrt(rows),
        "loss_at_temperature": {str(k): loss(tau, k) for k in ks},
        "loss_at_1": {str(k): loss(1.0, k) for k in ks},
    }
    logger.info("calibrated τ=%.4g on %s rows (top-1 loss %.4g, top-k %s)", tau, len(x), top1,
                calibration["loss_at_temperature"])
    return TemperatureFit(tau, calibration)


class _OutputCache:
    """Each expert's outputs on the rows some gate sent it, computed once per (row, expert)."""

    def __init__(
        self, x: torch.Tensor, forward: Callable[[int, torch.Tensor], torch.Tensor]
    ) -> None:
        self._x = x
        self._forward = forward
        self._done: dict[int, torch.Tensor] = {}  # expert -> rows computed [N] bool
        self._out: dict[int, torch.Tensor] = {}  # expert -> outputs [N, out] float64

    def mixture(self, routing: Any) -> torch.Tensor:
        experts, weights = routing.experts, routing.weights
        n = experts.shape[0]
        total: torch.Tensor | None = None
        for e in torch.unique(experts[experts >= 0]).tolist():
            rows_e, slot = torch.nonzero(experts == e, as_tuple=True)
            out = self._outputs(int(e), rows_e)
            if total is None:
                total = torch.zeros((n, out.shape[1]), dtype=torch.float64)
            total.index_add_(0, rows_e, out[rows_e] * weights[rows_e, slot, None])
        assert total is not None
        return total

    def _outputs(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        n = self._x.shape[0]
        done = self._done.setdefault(expert, torch.zeros(n, dtype=torch.bool))
        need = rows[~done[rows]]
        if need.numel():
            y = self._forward(expert, self._x[need]).to(torch.float64)
            out = self._out.setdefault(expert, torch.zeros((n, y.shape[1]), dtype=torch.float64))
            out[need] = y
            done[need] = True
        return self._out[expert]


def _row_losses(pred: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """Each row's loss [N] float64: cross-entropy, or the mean squared error of its outputs."""
    if task == "classification":
        return torch.nn.functional.cross_entropy(pred, y.to(torch.int64), reduction="none")
    return ((pred - y.to(torch.float64).reshape(pred.shape)) ** 2).mean(dim=1)


def calibrate_store(
    root: Path | str,
    data: Path | str,
    *,
    top_ks: Sequence[int] | None = None,
    target: str | None = None,
) -> Any:
    """Fit τ on a data file (.npz X, y / .csv / .parquet, whose `target` column is y) and
    republish the store with it.

    The experts' files are kept as they are (same content, so a server keeps them warm);
    the router is rewritten with the new τ and the manifest's gate block says how it was
    chosen. Returns the new Manifest.
    """
    from experts_store import GateSpec, Store, StoreWriter
    from router import PrototypeTree

    from ._datasets import read_data_file

    store = Store.open(root)
    m = store.manifest
    if m.kind != "momlp":
        # Graph nodes run one expert each, pMoE routes patches by its gate, a hyper store's
        # experts are generated per condition: none has a top-k softmax over prototypes.
        raise DataError(f"calibrate fits the top-k gate's τ of a momlp store; this store is "
                        f"of kind {m.kind!r}, which has none", source=str(root))
    if m.gate_spec.lift is not None:
        # Its τ is the one the router was trained with (Thm 3: set, never fitted after).
        raise DataError("a learned-linear store serves the τ its router was trained with; "
                        "it is not recalibrated", source=str(root))
    data = Path(data)
    # τ is fitted on every row of the file: nothing to split off, and rows of one class of
    # the store's are enough.
    table = read_data_file(data, target=target, task=m.task)
    x = table.x.astype(np.float32)
    if x.shape[1] != m.input_dim:
        raise DataError(
            f"X has {x.shape[1]} columns, the store takes {m.input_dim}", source=str(data)
        )
    if m.task == "classification":
        y = _store_labels(table.classes, m.extra.get("classes"), m.output_dim,
                          table.y.astype(np.int64), str(data))
    else:
        y = table.y.astype(np.float32)
        if y.shape[1] != m.output_dim:
            raise DataError(f"y has {y.shape[1]} columns, the store's experts output "
                            f"{m.output_dim}", source=str(data))
    tree = PrototypeTree.load(store.router_path)

    def forward(expert_id: int, rows: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return store.load_frozen(expert_id)(rows)

    spec = m.gate_spec
    # The writer first, based on the version read: a store that cannot be written (read-only,
    # full) says so before the fit, not after it; one published meanwhile (a build) is not
    # undone by a publish of this one's experts (StoreChanged says so, publishing nothing).
    with StoreWriter(store.root, based_on=store.version) as writer:
        # Calibrated stores serve top_k > 1 in tree routing as the soft tree walk: the
        # experts were trained on the tree's cells (format 1's exact nearest-k is kept for
        # exact routing).
        fit = fit_temperature(tree, forward, x, y, m.task, top_ks=top_ks, score=spec.score,
                              mode=m.routing, tree_top_k="beam", source=data.name)
        gate = GateSpec(
            score=spec.score,
            temperature=fit.temperature,
            temperature_source="calibrated",
            calibration=fit.calibration,
            hierarchy={"branching": m.branching, "depth": tree.depth},
            tree_top_k="beam",
        )
        report = store.report()
        for entry in m.experts:
            writer.link_expert_file(entry.id, store.root / entry.file)
        tree.with_temperature(fit.temperature).save(writer.router_path)
        if report is not None:
            writer.write_report({**report, "calibration": fit.calibration})
        return writer.publish(
            task=m.task, input_dim=m.input_dim, output_dim=m.output_dim, routing=m.routing,
            branching=m.branching, extra=m.extra, kind=m.kind, gate=gate,
        )


def _store_labels(
    file_classes: list[str], store_classes: Any, num_classes: int,
    labels: npt.NDArray[np.int64], source: str,
) -> npt.NDArray[np.int64]:
    """The store's class index of each row, from the file's labels (indices into
    `file_classes`, the file's distinct labels): by name where the store names its classes,
    else each label is itself an index below the store's `num_classes`."""
    if isinstance(store_classes, list):
        position = {str(c): i for i, c in enumerate(store_classes)}
    else:
        position = {str(i): i for i in range(num_classes)}
        # Labels written as floats (1.0) name the same indices.
        position.update({str(float(i)): i for i in range(num_classes)})
    missing = [c for c in file_classes if c not in position]
    if missing:
        raise DataError(f"labels {missing[:5]} are not classes of the store", source=source)
    table = np.array([position[c] for c in file_classes], dtype=np.int64)
    return table[labels]
