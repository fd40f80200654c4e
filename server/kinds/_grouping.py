"""Positions grouped by the id at each position: how every kind turns routing into groups."""

from __future__ import annotations

import torch

__all__ = ["group_positions", "sorted_groups"]


def sorted_groups(ids: torch.Tensor) -> tuple[list[int], torch.Tensor, list[int]]:
    """For a flat int64 tensor of ids (negative = none): the ids present, ascending; the
    positions that hold them, sorted by id and stably (ascending within an id); and how many
    positions each id has. Gathering once by these positions and splitting by the counts
    gives every group as a view, instead of gathering each group on its own."""
    used = torch.nonzero(ids >= 0).flatten()
    order = used[torch.argsort(ids[used], stable=True)]
    unique, counts = torch.unique_consecutive(ids[order], return_counts=True)
    return unique.tolist(), order, counts.tolist()


def group_positions(ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """For a flat int64 tensor of ids (negative = none), each id present, ascending, with the
    positions that hold it, ascending. Stable order is what keeps a group's rows (and so
    their sums) in the same order whatever else is in the batch."""
    unique, order, counts = sorted_groups(ids)
    return list(zip(unique, torch.split(order, counts), strict=True))
