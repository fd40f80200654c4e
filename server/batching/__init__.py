"""The batching floor: requests merged into batches, routed once, served by their kind.

It sits on the kinds floor (`server.kinds`) and knows nothing of HTTP: `Batcher.submit` takes
rows and the kind's resolved options and returns a `BatchAnswer` with the rows' outputs in
order and per-expert figures. How rows become groups and outputs is the kind's business.
"""

from __future__ import annotations

from server.batching._assemble import BatchAnswers
from server.batching._batcher import Batcher
from server.batching._route import RouteRunner
from server.batching._senders import OpenConnections
from server.batching._types import BatchAnswer, ExpertStat

__all__ = [
    "BatchAnswer",
    "BatchAnswers",
    "Batcher",
    "ExpertStat",
    "OpenConnections",
    "RouteRunner",
]
