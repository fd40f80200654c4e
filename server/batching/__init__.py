"""The batching floor: requests merged into batches, routed once, grouped by expert.

It sits on the pool floor (`server.pool`) and knows nothing of HTTP: `Batcher.submit` takes
rows and returns a `BatchAnswer` with the rows' outputs in order and per-expert figures.
"""

from __future__ import annotations

from server.batching._assemble import expert_groups, gather_outputs, request_answers
from server.batching._batcher import Batcher
from server.batching._types import BatchAnswer, ExpertStat, RouterLike, RoutingLike

__all__ = [
    "BatchAnswer",
    "Batcher",
    "ExpertStat",
    "RouterLike",
    "RoutingLike",
    "expert_groups",
    "gather_outputs",
    "request_answers",
]
