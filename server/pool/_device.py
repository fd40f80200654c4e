"""Where an actor computes and how it lays out a group's rows: the device it resolves to, the
row blocks that keep a row's bits independent of its group's size, the aligned input buffer,
and the activation peak it reports."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from experts_store import FrozenExpert

__all__ = [
    "ROW_BLOCK",
    "activation_peak_bytes",
    "aligned_input",
    "by_blocks",
    "resolve_device",
    "row_block",
]


# Rows of a group are computed in whole blocks of this many (zero rows pad the last one), each
# block its own GEMMs (`by_blocks`), so a row's bits never depend on its group's size. On CPU
# a group of 1-3 rows, the common case under Zipf traffic, then costs one 4-row forward. On
# CUDA 64 makes nearly every group one block: on an H100 it cost 1-16 % more than 16-row blocks
# for groups of 1-16 rows and saved 19-34 % at 40-64 (RESULTS, "The second GPU session").
ROW_BLOCK = {"cpu": 4, "cuda": 64}


def row_block(device: str) -> int:
    """Rows per block on `device` (a resolved device string, e.g. "cpu" or "cuda:0")."""
    return ROW_BLOCK["cuda" if device.startswith("cuda") else "cpu"]

# A caller's buffer is used as is when its rows start this aligned: 16 bytes give the same bits
# as torch's 64-byte-aligned buffers (benchmarks/gemm_alignment.py, part 1); numpy's small arrays
# are 16-byte aligned. Rows of width ROW_ALIGN·j keep the base's alignment.
_ALIGN_BYTES = 16


def resolve_device(device: str) -> str:
    """`auto` means CUDA when this process sees a GPU, else CPU; CUDA asked for where torch
    cannot use it is refused, naming why (an actor placed on a GPU node whose torch is a CPU
    build, say)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        cuda = torch.version.cuda
        build = "a CPU build" if cuda is None else f"built for CUDA {cuda}"
        raise RuntimeError(
            f"device {device!r} asked for, but torch {torch.__version__} on this node ({build}) "
            "sees no usable GPU; serve with --device cpu, or give the GPU nodes a CUDA build "
            "of torch"
        )
    return device


def activation_peak_bytes(widths: Sequence[int], rows: int, element_size: int = 4) -> int:
    """Largest input+output activation of any layer of a PReLU MLP over `rows` rows.

    A Linear layer holds its input (w_j) and output (w_{j+1}) at once; a PReLU or BatchNorm on
    a hidden width w holds 2·w. This is what the CPU path reports as the activation peak.
    """
    return rows * element_size * _peak_width(tuple(widths))


# Per arch, not per group: a store's experts share a few architectures.
@functools.lru_cache(maxsize=256)
def _peak_width(widths: tuple[int, ...]) -> int:
    linear = max(widths[j] + widths[j + 1] for j in range(len(widths) - 1))
    hidden = max((2 * w for w in widths[1:-1]), default=0)
    return max(linear, hidden)


def by_blocks(module: FrozenExpert, x: torch.Tensor, block: int) -> torch.Tensor:
    """`module` on `x` ([k·block, width]), each block of rows its own GEMMs.

    Batch invariance by construction: a row's bits then depend only on the block's fixed row
    count, never on how many rows share its group. Whether a larger GEMM would give a row the
    same bits is up to the kernel the BLAS picks on the host: the same CPU build of torch did
    for every multiple of 4 rows on an AMD EPYC and did not on an Intel Xeon (RESULTS.md,
    thirty-fourth session), and cuBLAS on an H100 did not either.
    """
    if x.shape[0] == block:
        return module(x)
    return torch.cat([module(x[i : i + block]) for i in range(0, x.shape[0], block)])


def aligned_input(rows: np.ndarray, height: int, width: int) -> torch.Tensor:
    """`rows` zero-padded to [height, width] in a buffer whose every row starts aligned.

    Batch invariance (CPU): GEMMs pick kernels by the row count, so a row's bits could
    depend on how many rows share its group; padded to whole ROW_BLOCKs, each its own GEMMs
    (`by_blocks`), they do not. And on some hosts this build's matmul sums a row in an order
    that depends on the row's alignment; the aligned expert's widths and an aligned buffer
    make that the same for every row.
    """
    if (
        rows.shape == (height, width)
        and rows.dtype == np.float32
        and rows.flags.c_contiguous
        and rows.flags.writeable  # Ray's arrays are read-only, which torch warns about
    ):
        x = torch.from_numpy(rows)
        if x.data_ptr() % _ALIGN_BYTES == 0:
            return x
    x = torch.zeros((height, width))  # torch's CPU allocator aligns to 64 bytes
    x.numpy()[: rows.shape[0], : rows.shape[1]] = rows
    return x
