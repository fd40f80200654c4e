"""Positions grouped by the id at each position: how every kind turns routing into groups."""

from __future__ import annotations

import torch

__all__ = ["group_positions"]


def group_positions(ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """For a flat int64 tensor of ids (negative = none), each id present, ascending, with the
    positions that hold it, ascending. Stable order is what keeps a group's rows (and so
    their sums) in the same order whatever else is in the batch."""
    used = torch.nonzero(ids >= 0).flatten()
    order = used[torch.argsort(ids[used], stable=True)]
    unique, counts = torch.unique_consecutive(ids[order], return_counts=True)
    return list(zip(unique.tolist(), torch.split(order, counts.tolist()), strict=True))
