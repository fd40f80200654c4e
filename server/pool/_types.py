"""Plain data passed between the batcher, the pools and the actors.

Two layers: what crosses the Ray boundary (`GroupOutcome`, `ActorReply`: numpy arrays only, so
Ray moves rows as out-of-band buffers and never pickles a tensor) and what the layer above sees
(`Group`, `GroupResult`: torch tensors). Experts are named by `ExpertRef`: the cache key
(content hash) plus what an actor needs to load the file; actors never open a store.

Records built per group or per request (`Group`, `GroupResult` and `GroupOutcome`) are plain
dataclasses, not frozen: a frozen dataclass sets each field through `object.__setattr__`, about
a microsecond more per record, and a 16-request batch builds ~200 of them (6 % of the server's
own path, measured by `benchmarks/server_path.py`). Nothing changes one after it is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from experts_store import ExpertRef

__all__ = [
    "ActorInfo",
    "ActorReply",
    "CacheCounts",
    "ExpertPool",
    "Group",
    "GroupOutcome",
    "GroupResult",
]


@dataclass  # not frozen: built per group or per request (module docstring)
class Group:
    """All rows of one batch that go to one expert."""

    expert: ExpertRef
    rows: torch.Tensor  # [m, n] float32

    @property
    def expert_id(self) -> int:
        return self.expert.expert_id


@dataclass  # not frozen: built per group or per request (module docstring)
class GroupResult:
    """The answer for one `Group`, in the order the groups were given.

    `error` is set (and `outputs` empty) when the expert could not be served, e.g. a bad
    checksum or a missing file: only the requests that need that expert fail.
    """

    expert_id: int
    outputs: torch.Tensor  # [m, out]
    hit: bool
    load_ms: float
    compute_ms: float
    expert_bytes: int
    activation_bytes: int
    actor: str
    device_bytes: int = 0  # resident expert bytes of the actor after the call
    error: str | None = None
    error_kind: str | None = None
    key: str | None = None  # a generated θ's cache key (kind hyper); None for expert files
    generator_bytes: int = 0  # bytes of the pinned hypernetwork that generated it
    # A file that failed to load is remembered: seconds until the pool reads it again.
    retry_after_s: float | None = None


@dataclass  # not frozen: built per group or per request (module docstring)
class GroupOutcome:
    """An actor's answer for one group, as it crosses the Ray boundary (numpy only)."""

    expert_id: int
    outputs: np.ndarray | None
    hit: bool = False
    load_ms: float = 0.0
    compute_ms: float = 0.0
    expert_bytes: int = 0
    activation_bytes: int = 0
    error: str | None = None
    error_kind: str | None = None  # "load" (bad file: remembered), "busy", "internal"
    key: str | None = None  # a generated θ's cache key (kind hyper)
    generator_bytes: int = 0  # its pinned hypernetwork's bytes


@dataclass(frozen=True)
class CacheCounts:
    """An actor cache's counters: in an actor's reply, since its process started; in the
    pool's `ActorInfo`, over the pool's life (the processes that died added in).

    `loads` counts what the cache loaded (expert files; for kind hyper, each generated θ and
    the hypernetwork), once each however many requests waited for it (the HTTP layer's
    miss counter counts every (request, expert) wait).
    """

    evictions: int = 0
    loads: int = 0
    load_bytes: int = 0


@dataclass(frozen=True)
class ActorReply:
    """One actor call's answer: per-group outcomes plus the actor's cache after the call.

    `resident` maps cache keys (expert content hashes) to bytes; `process` names the
    actor's process that answered (new with each start of it), whose counts `counts` are.
    """

    actor: str
    results: list[GroupOutcome]
    device_bytes: int
    resident: dict[str, int]
    counts: CacheCounts = CacheCounts()
    process: str = ""


@dataclass(frozen=True)
class ActorInfo:
    """What the pool knows about one actor; `resident` lists cache keys (content hashes)."""

    name: str
    device: str
    resident_bytes: int
    budget_bytes: int
    resident: list[str] = field(default_factory=list)
    alive: bool = True
    counts: CacheCounts = CacheCounts()  # as of the actor's latest reply
    # Its processes' ends the pool noticed over its life, by cause ("died", "hung": killed
    # past MOMLP_ACTOR_CALL_TIMEOUT_S), each one a restart of Ray's spent or a replacement.
    failures: dict[str, int] = field(default_factory=dict)
    # Whether it is a suspect now (it left a health check unanswered: it takes no rows until
    # it answers, `_suspects`), how many times it became one, and how many of its calls were
    # given up then (their rows run on another actor).
    suspect: bool = False
    suspicions: int = 0
    given_up_calls: int = 0
    # The process that answered, in an actor's own answer (as `ActorReply.process`): a
    # health check tells from it a restart no call saw. Empty in the pool's view.
    process: str = ""


class ExpertPool(Protocol):
    """The seam between the batcher and whatever runs experts (Ray actors or in-process).

    A pool outlives store versions: it is built once per server and fed `ExpertRef`s of
    whichever version a request entered.
    """

    @property
    def budget_bytes(self) -> int: ...
    @property
    def device(self) -> str: ...  # where the actors keep experts: "cpu" or "cuda"
    # Raises a failure as it comes, when calls of the batch may still compute:
    # `calls_settled(error)` returns once they have ended.
    # `wanted`: whether a caller still waits for the answers; a death or hang when none does
    # is not retried (it fails the run with `ActorFailed`). None: always.
    async def run(
        self, groups: list[Group], *, wanted: Callable[[], bool] | None = None
    ) -> list[GroupResult]: ...
    async def prefetch(self, experts: Sequence[ExpertRef]) -> None: ...
    # A new store version went live: what was popular under the old one is not evidence.
    async def forget_popularity(self) -> None: ...
    def residency(self) -> dict[str, list[str]]: ...
    def actors(self) -> list[ActorInfo]: ...
    async def close(self) -> None: ...
