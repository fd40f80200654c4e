"""The manifest block of a store of kind "pmoe" (patch-level mixture of experts, paper 003).

An input of a pmoe store is n patches of dimension d, sent as a flat row of n·d values (patch
after patch) or, for an image layout, as an [H, W, C] image the server cuts into
non-overlapping ph x pw patches in row-major grid order. Each expert is an ordinary expert
file: a per-patch MLP d -> h -> c (ReLU, the paper's fixed output layer folded into its last
linear layer), so a sample's output is the gate-weighted sum of its experts' outputs over the
patches each expert was given.

Routing:
- ``expert_choice``: the router file holds ``router_weight`` [k, d] (w_s); expert s takes,
  per sample, the l patches with the largest <w_s, x^(j)> (ties to the lowest patch index).
- ``token_choice``: the router file is a prototype tree (k prototypes in R^d); each patch goes
  to its nearest prototype's expert, so only the experts some patch picked are loaded.

Gating: ``softmax`` over an expert's l selected router values, or ``ones``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from experts_store._arch import ExpertArch

__all__ = ["PATCH_ALIGN", "PMOE_ROUTER_TENSOR", "ImageLayout", "PatchLayout", "PMoESpec"]

# Name of the [k, d] router matrix inside an expert-choice store's router file.
PMOE_ROUTER_TENSOR = "router_weight"
# Experts take patches zero-padded to a multiple of this many values, and their hidden widths
# are padded (with zero neurons) the same way: CPU GEMM kernels otherwise sum a row in an
# order that depends on its memory alignment, i.e. on where the row sits in its group, and a
# sample's output would depend on the other samples of its batch.
PATCH_ALIGN = 8


def aligned(width: int) -> int:
    """`width` rounded up to a multiple of PATCH_ALIGN."""
    return -(-width // PATCH_ALIGN) * PATCH_ALIGN


class ImageLayout(BaseModel):
    """[H, W, C] images cut into non-overlapping ph x pw patches, row-major over the grid;
    each patch is flattened as (row, column, channel), i.e. ph·pw·C values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    height: int = Field(ge=1)
    width: int = Field(ge=1)
    channels: int = Field(ge=1)
    patch_height: int = Field(ge=1)
    patch_width: int = Field(ge=1)

    @model_validator(mode="after")
    def _check_tiling(self) -> ImageLayout:
        if self.height % self.patch_height or self.width % self.patch_width:
            raise ValueError(
                f"{self.height}x{self.width} images do not split into "
                f"{self.patch_height}x{self.patch_width} patches"
            )
        return self

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, self.channels)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.height // self.patch_height, self.width // self.patch_width)

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def patch_dim(self) -> int:
        return self.patch_height * self.patch_width * self.channels


class PatchLayout(BaseModel):
    """n patches of d values; `image` when inputs may also come as images."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_patches: int = Field(ge=1)
    patch_dim: int = Field(ge=1)
    image: ImageLayout | None = None

    @model_validator(mode="after")
    def _check_image(self) -> PatchLayout:
        if self.image is not None and (
            self.image.num_patches != self.num_patches or self.image.patch_dim != self.patch_dim
        ):
            raise ValueError(
                f"image layout gives {self.image.num_patches} patches of "
                f"{self.image.patch_dim}, the store has {self.num_patches} of {self.patch_dim}"
            )
        return self

    @property
    def input_dim(self) -> int:
        return self.num_patches * self.patch_dim

    @property
    def expert_input_dim(self) -> int:
        """What an expert takes: a patch zero-padded to a multiple of PATCH_ALIGN."""
        return aligned(self.patch_dim)


class PMoESpec(BaseModel):
    """`manifest["pmoe"]`: input layout, routing mode, gating, and how it was trained."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layout: PatchLayout
    routing: Literal["expert_choice", "token_choice"] = "expert_choice"
    patches_per_expert: int | None = Field(default=None, ge=1, description="l (expert choice)")
    gating: Literal["softmax", "ones"] = "softmax"
    num_classes: int = Field(ge=2)
    hidden: int = Field(ge=1, description="neurons of each expert (before padding)")
    train: Literal["separate", "joint"] | None = None

    @model_validator(mode="after")
    def _check_routing(self) -> PMoESpec:
        l_value = self.patches_per_expert
        if self.routing == "expert_choice":
            if l_value is None or l_value > self.layout.num_patches:
                raise ValueError(
                    f"expert choice needs patches_per_expert in 1..{self.layout.num_patches}, "
                    f"got {l_value}"
                )
        elif l_value is not None:
            raise ValueError("token choice takes no patches_per_expert")
        if self.routing == "token_choice" and self.gating != "ones":
            raise ValueError("token choice gates every patch with ones")
        return self

    def check_store(
        self, *, input_dim: int, output_dim: int, archs: Sequence[ExpertArch]
    ) -> None:
        """ValueError unless the store's dims and every expert fit this layout."""
        if input_dim != self.layout.input_dim:
            raise ValueError(
                f"input_dim {input_dim} is not n·d = {self.layout.num_patches}·"
                f"{self.layout.patch_dim}"
            )
        if output_dim != self.num_classes:
            raise ValueError(f"output_dim {output_dim} is not num_classes {self.num_classes}")
        expected = self.layout.expert_input_dim
        for expert_id, arch in enumerate(archs):
            if arch.input_dim != expected or arch.output_dim != output_dim:
                raise ValueError(
                    f"expert {expert_id}: arch maps {arch.input_dim} -> {arch.output_dim}, "
                    f"a patch expert maps {expected} (d={self.layout.patch_dim} padded) -> "
                    f"{output_dim}"
                )
