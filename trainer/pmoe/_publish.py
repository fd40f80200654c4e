"""A trained `PatchMoE` as a store of kind "pmoe": expert files, router file, manifest block.

Expert s of the model computes, for one patch x, relu(W_s x) and reads it out through the
fixed output layer a_s, divided by n (the model pools over all n patch positions). That is an
ordinary expert file d -> h -> c: first layer W_s (no bias), PReLU with γ = 0 (ReLU), last
layer a_s^T / n (no bias). For two classes the model's logits are (0, f), so the last layer's
first row is zero. A sample's logits are then the gate-weighted sum of its experts' outputs
over the patches each expert took, which is what the server computes.

Token choice (optional): each patch goes to its nearest prototype through a prototype tree,
one prototype per expert: the mean of the training patches that expert took under expert
choice. `token_choice_logits` is the offline reading of such a store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save

from experts_store import (
    PATCH_ALIGN,
    PMOE_ROUTER_TENSOR,
    ExpertArch,
    ExpertMLP,
    ImageLayout,
    Manifest,
    PatchLayout,
    PMoESpec,
    StoreWriteError,
    StoreWriter,
)
from router import PrototypeTree

from ._exceptions import PMoEConfigError
from ._model import PatchMoE, as_patches

__all__ = [
    "PatchRoutingMode",
    "expert_mlp",
    "publish_pmoe",
    "token_choice_logits",
    "token_prototypes",
]

PatchRoutingMode = Literal["expert_choice", "token_choice"]


def _readout(model: PatchMoE, expert_id: int) -> torch.Tensor:
    """[c, h]: expert `expert_id`'s fixed output weights over n, one row per class logit."""
    a = model.output_weight[expert_id].detach().to(torch.float32) / model.num_patches  # [h, o]
    if model.num_classes == 2:
        return torch.cat([torch.zeros(1, model.hidden), a.T], dim=0)
    return a.T.contiguous()


def _aligned(width: int) -> int:
    return -(-width // PATCH_ALIGN) * PATCH_ALIGN


@torch.no_grad()
def expert_mlp(model: PatchMoE, expert_id: int) -> ExpertMLP:
    """Expert `expert_id` of `model` as a per-patch MLP d -> h -> num_classes.

    d and h are zero-padded to multiples of PATCH_ALIGN (zero weights: the same function)
    so that the server's results do not depend on a row's alignment in its group.
    """
    d, h = model.patch_dim, model.hidden
    arch = ExpertArch(widths=(_aligned(d), _aligned(h), model.num_classes), prelu_init=0.0)
    expert = ExpertMLP(arch)
    first, last = expert.linears[0], expert.linears[1]
    assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
    first.weight.zero_()
    first.weight[:h, :d] = model.expert_weight[expert_id].detach()
    first.bias.zero_()
    last.weight.zero_()
    last.weight[:, :h] = _readout(model, expert_id)
    last.bias.zero_()
    expert.eval()
    return expert


@torch.no_grad()
def token_prototypes(model: PatchMoE, x: torch.Tensor) -> torch.Tensor:
    """[k, d]: per expert, the mean of the patches it takes (expert choice) over `x`."""
    patches = as_patches(x.float(), model.num_patches, model.patch_dim)
    indices = model.route(patches).indices  # [B, k, l]
    rows = torch.arange(patches.shape[0])[:, None, None]
    taken = patches[rows, indices]  # [B, k, l, d]
    return taken.mean(dim=(0, 2)).to(torch.float32)


@torch.no_grad()
def token_choice_logits(
    model: PatchMoE, tree: PrototypeTree, x: torch.Tensor, mode: Literal["tree", "exact"] = "tree"
) -> torch.Tensor:
    """Logits [B, c] when each patch goes to its nearest prototype's expert (gates of one)."""
    patches = as_patches(x.float(), model.num_patches, model.patch_dim)
    b, n, d = patches.shape
    experts = tree.route(patches.reshape(b * n, d), mode=mode).experts[:, 0].reshape(b, n)
    out = torch.zeros(b, model.num_classes, dtype=torch.float64)
    for s in range(model.num_experts):
        hidden = torch.relu(patches @ model.expert_weight[s].T)  # [B, n, h]
        per_patch = (hidden @ _readout(model, s).T).to(torch.float64)  # [B, n, c]
        out += (per_patch * (experts == s)[..., None]).sum(dim=1)
    return out.to(torch.float32)


def publish_pmoe(
    model: PatchMoE,
    out: Path,
    *,
    train: Literal["separate", "joint"] | None = None,
    image: ImageLayout | None = None,
    routing: PatchRoutingMode = "expert_choice",
    tree: PrototypeTree | None = None,
    report: dict[str, Any] | None = None,
) -> Manifest:
    """Write `model` as a pmoe store at `out` (atomically; manifest last) and return its manifest.

    Token choice needs `tree` (one prototype per expert, in R^d).
    """
    layout = PatchLayout(num_patches=model.num_patches, patch_dim=model.patch_dim, image=image)
    token = routing == "token_choice"
    if token and (tree is None or tree.num_prototypes != model.num_experts):
        raise PMoEConfigError("token choice needs a tree of one prototype per expert",
                              option="routing")
    spec = PMoESpec(
        layout=layout,
        routing=routing,
        patches_per_expert=None if token else model.patches_per_expert,
        gating="ones" if token else model.gating,
        num_classes=model.num_classes,
        hidden=model.hidden,
        train=train,
    )
    with StoreWriter(out) as writer:
        for s in range(model.num_experts):
            writer.add_expert(s, expert_mlp(model, s))
        if token:
            assert tree is not None
            tree.save(writer.router_path)
        else:
            weight = model.router.detach().to(torch.float32).contiguous()
            if not bool(torch.isfinite(weight).all()):
                # A server refuses such a router (every patch's score would be NaN).
                raise StoreWriteError(
                    path=writer.router_path,
                    reason="the router's weights hold NaN or infinite values (did its "
                    "training diverge?)",
                )
            # Not save_file, which creates its file 0600: the router must be as readable as
            # the store's other files (router/_io.py says why).
            writer.router_path.write_bytes(save({PMOE_ROUTER_TENSOR: weight}))
        if report is not None:
            writer.write_report(report)
        return writer.publish(
            task="classification",
            input_dim=layout.input_dim,
            output_dim=model.num_classes,
            routing="tree" if token else "exact",
            branching=tree.branching if tree is not None and token else 2,
            kind="pmoe",
            pmoe=spec,
        )

