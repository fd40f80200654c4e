"""What Sec. 5.1 measures: test accuracy, and whether the routers find the discriminative patch.

- `accuracy`: fraction of samples whose largest logit is their class.
- `discriminative_in_top`: Fig. 8 — for a separately trained pMoE (expert s serves class s),
  the fraction of samples whose discriminative patch is among the top-q router values of their
  class's expert, for each depth q.
- `largest_gate_hits`: Fig. 9 — for a jointly trained pMoE, per class, the expert that most
  often gives the discriminative patch its largest gate (chosen on one set of samples, e.g.
  training data) and the fraction of samples of that class (e.g. test data) where it does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ._exceptions import PMoEConfigError
from ._model import PatchCNN, PatchMoE
from ._train import predict_logits

__all__ = ["ClassGateHit", "accuracy", "discriminative_in_top", "largest_gate_hits"]

Array = npt.NDArray[np.float32] | npt.NDArray[np.int64]


@dataclass(frozen=True)
class ClassGateHit:
    """Class `label`: `expert` gives the discriminative patch its largest gate for `fraction`."""

    label: int
    expert: int
    fraction: float
    samples: int


def accuracy(model: PatchMoE | PatchCNN, x: Array, y: Array) -> float:
    logits = predict_logits(model, x)
    return float((logits.argmax(dim=1) == torch.from_numpy(np.asarray(y))).float().mean())


@torch.no_grad()
def _scores(model: PatchMoE, x: Array) -> torch.Tensor:
    inputs = torch.from_numpy(np.asarray(x, dtype=np.float32))
    return torch.cat([model.router_scores(chunk) for chunk in torch.split(inputs, 512)])


def discriminative_in_top(
    model: PatchMoE, x: Array, y: Array, position: Array, depths: list[int]
) -> dict[int, float]:
    """{q: fraction of samples whose discriminative patch ranks in the top q of expert y's router}.

    Ranks break ties toward the lower patch index, as routing does.
    """
    if model.num_experts != model.num_classes:
        raise PMoEConfigError("needs one expert per class (separate training)", option="model")
    scores = _scores(model, x)  # [N, k, n]
    labels = torch.from_numpy(np.asarray(y, dtype=np.int64))
    rows = torch.arange(len(labels))
    own = scores[rows, labels]  # [N, n]: the router of each sample's class
    order = torch.sort(own, dim=1, descending=True, stable=True).indices
    target = torch.from_numpy(np.asarray(position, dtype=np.int64))
    rank = (order == target[:, None]).int().argmax(dim=1)  # 0 = top
    return {q: float((rank < q).float().mean()) for q in depths}


@torch.no_grad()
def _first_pick_is_discriminative(model: PatchMoE, x: Array, position: Array) -> torch.Tensor:
    """[N, k] bool: expert s's largest gate is on the discriminative patch."""
    inputs = torch.from_numpy(np.asarray(x, dtype=np.float32))
    tops = torch.cat([model.route(chunk).indices[:, :, 0] for chunk in torch.split(inputs, 512)])
    target = torch.from_numpy(np.asarray(position, dtype=np.int64))
    # Indices come in descending router value and softmax keeps that order, so the first pick
    # holds the largest gate (a tie in value goes to the lower index, as in routing).
    return tops == target[:, None]


def largest_gate_hits(
    model: PatchMoE,
    fit: tuple[Array, Array, Array],
    check: tuple[Array, Array, Array],
) -> list[ClassGateHit]:
    """Per class: pick the expert on `fit` = (x, y, position), report its hit rate on `check`."""
    x_fit, y_fit, pos_fit = fit
    x_check, y_check, pos_check = check
    hits_fit = _first_pick_is_discriminative(model, x_fit, pos_fit).float()
    hits_check = _first_pick_is_discriminative(model, x_check, pos_check).float()
    labels_fit = torch.from_numpy(np.asarray(y_fit, dtype=np.int64))
    labels_check = torch.from_numpy(np.asarray(y_check, dtype=np.int64))
    answer: list[ClassGateHit] = []
    for label in range(model.num_classes):
        mine_fit = labels_fit == label
        mine_check = labels_check == label
        if not bool(mine_fit.any()) or not bool(mine_check.any()):
            continue
        expert = int(hits_fit[mine_fit].mean(dim=0).argmax())
        fraction = float(hits_check[mine_check, expert].mean())
        answer.append(ClassGateHit(label, expert, fraction, int(mine_check.sum())))
    return answer
