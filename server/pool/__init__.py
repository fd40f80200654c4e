"""The pool floor: Ray actors that hold experts in a byte-budgeted, content-keyed cache.

Nothing here knows about HTTP, batching or store versions: the layer above hands it groups
of rows, each named by an `ExpertRef`, and gets outputs back in the same order.
"""

from __future__ import annotations

from server.pool._actor import ActorCore, ExpertActor
from server.pool._base import DispatchingPool
from server.pool._budget import check_budget
from server.pool._channel import Channel, ChannelServer
from server.pool._device import ROW_BLOCK, activation_peak_bytes, resolve_device, row_block
from server.pool._dispatch import Dispatcher, rendezvous_rank
from server.pool._errors import (
    ActorDied,
    ActorGone,
    ChannelCallFailed,
    ChannelClosed,
    ChannelError,
    WireError,
)
from server.pool._fake import FakeExpertPool
from server.pool._loader import without_root
from server.pool._ray import RayExpertPool
from server.pool._session import ray_session, start_ray, stop_ray
from server.pool._settle import calls_settled
from server.pool._sizing import actor_count, actor_device
from server.pool._threads import in_daemon_thread
from server.pool._types import (
    ActorInfo,
    ActorReply,
    CacheCounts,
    ExpertPool,
    Group,
    GroupOutcome,
    GroupResult,
)

__all__ = [
    "ROW_BLOCK",
    "ActorCore",
    "ActorDied",
    "ActorGone",
    "ActorInfo",
    "ActorReply",
    "CacheCounts",
    "Channel",
    "ChannelCallFailed",
    "ChannelClosed",
    "ChannelError",
    "ChannelServer",
    "Dispatcher",
    "DispatchingPool",
    "ExpertActor",
    "ExpertPool",
    "FakeExpertPool",
    "Group",
    "GroupOutcome",
    "GroupResult",
    "RayExpertPool",
    "WireError",
    "activation_peak_bytes",
    "actor_count",
    "actor_device",
    "calls_settled",
    "check_budget",
    "in_daemon_thread",
    "ray_session",
    "rendezvous_rank",
    "resolve_device",
    "row_block",
    "start_ray",
    "stop_ray",
    "without_root",
]
