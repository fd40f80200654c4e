"""Patch-level mixture of experts (pMoE, paper 003 eq. 1 and 23) and its CNN counterpart (eq. 5).

An input holds n patches of dimension d. Each of k experts owns a linear router w_s in R^d and
takes, per sample, the l patches with the largest <w_s, x^(j)> (expert-choice routing; ties go
to the lowest patch index). An expert is a two-layer CNN: a per-patch ReLU layer of h neurons
(no bias) and a fixed, untrained output layer. With gating `ones` (separate training, eq. 3)
every selected patch counts once; with `softmax` (joint training, eq. 4) it is weighted by the
softmax of the router values over the l selected patches.

    model = PatchMoE(num_patches=16, patch_dim=64, num_experts=2, patches_per_expert=2,
                     hidden=20, num_classes=2, gating="ones", output_layer="expert_class")
    logits = model(x)              # x: [B, n, d] or [B, n*d] -> [B, num_classes]
    routing = model.route(x)       # .indices [B, k, l], .gates [B, k, l]

Outputs are per-class logits. For two classes the model is the paper's single-output f with
logits (0, f): their softmax is sigmoid(f), so cross-entropy on them is eq. 2's logistic loss.

The pooled hidden activations are divided by n, not l: the authors' code pools over all n
patch positions with unselected ones zeroed. Eq. 1 writes 1/l; the two differ by the constant
n/l, which only rescales the fixed output layer.

Every reduction is an elementwise product summed over its last axis, never a BLAS matmul:
a matmul may pick a different kernel (and summation order) for a different batch size, while
a row's sum here is the same whichever rows share its batch. A sample's output is therefore
bitwise the same alone and inside any batch (on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ._exceptions import PatchLayoutError, PMoEConfigError

__all__ = [
    "Gating",
    "OutputLayer",
    "PatchCNN",
    "PatchMoE",
    "PatchRouting",
    "as_patches",
    "top_l_patches",
]

Gating = Literal["ones", "softmax"]
OutputLayer = Literal["gaussian", "expert_class"]


@dataclass(frozen=True)
class PatchRouting:
    """Which patches each expert took for each sample, in descending router value.

    `indices` [B, k, l] (int64) are patch indices 0..n-1, `gates` [B, k, l] their gating
    values (ones, or a softmax over the l), `scores` [B, k, n] every router value.
    """

    indices: torch.Tensor
    gates: torch.Tensor
    scores: torch.Tensor


def top_l_patches(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` (l) largest scores on the last axis, largest first, ties to the lowest
    index.

    `scores` is [..., n]; the answer is [..., count] (int64). A stable descending sort keeps equal
    scores in index order, which torch.topk does not promise.
    """
    n = scores.shape[-1]
    if not 1 <= count <= n:
        raise PMoEConfigError(f"must be in 1..{n}, got {count}", option="patches_per_expert")
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :count]


def as_patches(x: torch.Tensor, num_patches: int, patch_dim: int) -> torch.Tensor:
    """View a batch as [B, n, d]; flat rows [B, n*d] are cut into n consecutive patches."""
    if x.dim() == 2 and x.shape[1] == num_patches * patch_dim:
        return x.reshape(x.shape[0], num_patches, patch_dim)
    if x.dim() == 3 and tuple(x.shape[1:]) == (num_patches, patch_dim):
        return x
    raise PatchLayoutError(expected=(num_patches, patch_dim), got=tuple(x.shape))


def _dot_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) with broadcasting; per-row order fixed whatever the batch size."""
    return (a * b).sum(dim=-1)


def _output_layer(
    kind: OutputLayer, experts: int, hidden: int, num_classes: int, generator: torch.Generator
) -> torch.Tensor:
    """The fixed output weights a[s, r, c] (c = 1 for two classes, else num_classes)."""
    outputs = 1 if num_classes == 2 else num_classes
    if kind == "gaussian":
        # Sec. 3.2: sampled once from N(0, 1) and never trained.
        return torch.randn(experts, hidden, outputs, generator=generator)
    if experts != num_classes:
        raise PMoEConfigError(
            f"expert_class needs one expert per class ({num_classes}), got {experts}",
            option="num_experts",
        )
    # The authors' separate-training experts: expert s's neurons vote for class s only
    # (for two classes: +1 for expert 1, -1 for expert 0 on the single logit f).
    if num_classes == 2:
        signs = torch.tensor([-1.0, 1.0])
        return signs[:, None, None].expand(2, hidden, 1).clone()
    return torch.eye(num_classes)[:, None, :].expand(experts, hidden, num_classes).clone()


def _read_out(pooled: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
    """[B, m] pooled activations (m = all neurons) times the fixed [..., c] output weights."""
    weights = output_weight.reshape(-1, output_weight.shape[-1]).T  # [c, m]
    return _dot_last(pooled[:, None, :], weights[None])


def _class_logits(f: torch.Tensor, num_classes: int) -> torch.Tensor:
    if num_classes == 2:
        return torch.cat([torch.zeros_like(f), f], dim=1)
    return f


class PatchMoE(nn.Module):
    """k experts (two-layer CNNs of `hidden` neurons each), each given its top-l patches."""

    output_weight: torch.Tensor

    def __init__(
        self,
        *,
        num_patches: int,
        patch_dim: int,
        num_experts: int,
        patches_per_expert: int,
        hidden: int,
        num_classes: int = 2,
        gating: Gating = "softmax",
        output_layer: OutputLayer = "gaussian",
        router_init_std: float = 1e-4,
        expert_init_std: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for option, value, low in (
            ("num_patches", num_patches, 1),
            ("patch_dim", patch_dim, 1),
            ("num_experts", num_experts, 1),
            ("hidden", hidden, 1),
            ("num_classes", num_classes, 2),
        ):
            if value < low:
                raise PMoEConfigError(f"must be >= {low}, got {value}", option=option)
        if not 1 <= patches_per_expert <= num_patches:
            raise PMoEConfigError(
                f"must be in 1..{num_patches}, got {patches_per_expert}",
                option="patches_per_expert",
            )
        if gating not in ("ones", "softmax"):
            raise PMoEConfigError(f"must be ones or softmax, got {gating!r}", option="gating")
        self.num_patches = num_patches
        self.patch_dim = patch_dim
        self.num_experts = num_experts
        self.patches_per_expert = patches_per_expert
        self.hidden = hidden
        self.num_classes = num_classes
        self.gating: Gating = gating
        generator = torch.Generator().manual_seed(seed)
        self.router = nn.Parameter(
            torch.randn(num_experts, patch_dim, generator=generator) * router_init_std
        )
        self.expert_weight = nn.Parameter(
            torch.randn(num_experts, hidden, patch_dim, generator=generator) * expert_init_std
        )
        self.register_buffer(
            "output_weight",
            _output_layer(output_layer, num_experts, hidden, num_classes, generator),
        )

    def router_scores(self, x: torch.Tensor) -> torch.Tensor:
        """<w_s, x^(j)> for every expert s and patch j: [B, k, n]."""
        patches = as_patches(x, self.num_patches, self.patch_dim)
        return _dot_last(patches[:, None, :, :], self.router[None, :, None, :])

    def route(self, x: torch.Tensor) -> PatchRouting:
        """Each expert's top-l patches per sample and their gates (differentiable in `gates`)."""
        scores = self.router_scores(x)
        indices = top_l_patches(scores, self.patches_per_expert)
        if self.gating == "softmax":
            gates = torch.softmax(torch.gather(scores, 2, indices), dim=-1)
        else:
            gates = torch.ones(indices.shape, dtype=scores.dtype)
        return PatchRouting(indices=indices, gates=gates, scores=scores)

    def forward_routed(self, x: torch.Tensor) -> tuple[torch.Tensor, PatchRouting]:
        """Logits [B, num_classes] and the routing that produced them."""
        patches = as_patches(x, self.num_patches, self.patch_dim)
        routing = self.route(patches)
        rows = torch.arange(patches.shape[0])[:, None, None]
        selected = patches[rows, routing.indices]  # [B, k, l, d]
        # [B, k, h, l]: the patch axis last, so that pooling is a last-axis sum too.
        hidden = torch.relu(_dot_last(selected[:, :, None], self.expert_weight[None, :, :, None]))
        pooled = _dot_last(hidden, routing.gates[:, :, None, :]) / self.num_patches  # [B, k, h]
        f = _read_out(pooled.reshape(pooled.shape[0], -1), self.output_weight)
        return _class_logits(f, self.num_classes), routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_routed(x)[0]

    def expert_macs_per_sample(self) -> int:
        """Multiply-adds of the experts' hidden layers per sample: k·h·l·d = m·l·d (Table 1)."""
        return self.num_experts * self.hidden * self.patches_per_expert * self.patch_dim

    def router_macs_per_sample(self) -> int:
        """Multiply-adds of the routers per sample: k·n·d (Table 1)."""
        return self.num_experts * self.num_patches * self.patch_dim


class PatchCNN(nn.Module):
    """The single-expert counterpart (eq. 5): every patch through one CNN of `hidden` neurons."""

    output_weight: torch.Tensor

    def __init__(
        self,
        *,
        num_patches: int,
        patch_dim: int,
        hidden: int,
        num_classes: int = 2,
        init_std: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if hidden < 1 or num_classes < 2:
            raise PMoEConfigError("hidden must be >= 1 and num_classes >= 2", option="hidden")
        self.num_patches = num_patches
        self.patch_dim = patch_dim
        self.hidden = hidden
        self.num_classes = num_classes
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(hidden, patch_dim, generator=generator) * init_std)
        self.register_buffer(
            "output_weight", _output_layer("gaussian", 1, hidden, num_classes, generator)[0]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = as_patches(x, self.num_patches, self.patch_dim)
        hidden = torch.relu(_dot_last(patches[:, None, :, :], self.weight[None, :, None, :]))
        pooled = hidden.sum(dim=-1) / self.num_patches  # [B, h]
        return _class_logits(_read_out(pooled, self.output_weight), self.num_classes)

    def expert_macs_per_sample(self) -> int:
        """Multiply-adds of the hidden layer per sample: m·n·d (Table 1)."""
        return self.hidden * self.num_patches * self.patch_dim
