"""`RayExpertPool`: the expert pool on real Ray actors, one per device.

Ray is imported inside the methods, so importing this module does not start or need Ray.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from experts_store import Clock, ExpertRef
from server._exceptions import ActorFailed, PoolStartFailed
from server._settings import Settings
from server.pool._actor import ExpertActor
from server.pool._actor_start import (
    StartStopped,
    cluster_room,
    kill_bounded,
    last_line,
    start_in_place,
    wait_until_up,
)
from server.pool._base import DispatchingPool
from server.pool._channel import Channel
from server.pool._channel_dir import make_channel_folder, sweep_stale_folders
from server.pool._device import resolve_device
from server.pool._errors import ActorDied, ActorGone, ChannelCallFailed, ChannelClosed
from server.pool._health import PROBE_GROUP
from server.pool._kill import kill_hung_process
from server.pool._sizing import actor_count, actor_device, local_node_gpus
from server.pool._threads import in_daemon_thread
from server.pool._types import ActorInfo, ActorReply

__all__ = ["RayExpertPool"]

logger = logging.getLogger(__name__)


# How long the GCS may take to accept a TCP connection before the cluster counts as gone.
_GCS_PROBE_S = 2.0


def _gcs_address(context: Any) -> str | None:
    """host:port of the Ray cluster's GCS, or None where Ray does not say (Ray Client)."""
    try:
        address = context.gcs_address
    except Exception:  # Ray raises its own errors for a context without one
        return None
    return address if isinstance(address, str) and ":" in address else None


class RayExpertPool(DispatchingPool):
    """One Ray actor per device (per GPU on CUDA, `settings.actors` on CPU), created once and
    kept for the server's lifetime: a new store version never creates an actor (one whose
    restarts are spent is replaced, `_replace`).

    With `channels` (a folder on the server's node, `settings.actor_channel == "socket"`),
    `run` calls go over a Unix socket to each actor on this node (`_channel`), opened on the
    first call and again after the actor restarts; other calls, and actors on other nodes,
    use Ray's calls.
    """

    def __init__(
        self,
        handles: dict[str, Any],
        *,
        device: str,
        settings: Settings,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        failure_ttl_s: float = 30.0,
        channels: Path | None = None,
        node_id: str | None = None,
        gcs_address: str | None = None,
        start_actor: Callable[[str], Any] | None = None,
    ) -> None:
        super().__init__(
            list(handles),
            device=device,
            budget_bytes=settings.cache_bytes,
            spill_queue_rows=settings.spill_queue_rows,
            clock=clock,
            sleep=sleep,
            failure_ttl_s=failure_ttl_s,
            call_timeout_s=settings.actor_call_timeout_s,
            replace_interval_s=settings.actor_replace_interval_s,
        )
        self._handles = handles
        # Makes a new actor's handle, as `create` made the first ones (None: no replacements).
        self._start_actor = start_actor
        self._start_timeout_s = settings.actor_start_timeout_s
        self._channel_dir = channels
        self._node_id = node_id
        self._gcs_address = gcs_address
        # Absent: not opened since the actor (re)started; None: this actor uses Ray's calls.
        self._channels: dict[str, Channel | None] = {}
        self._channel_locks = {name: asyncio.Lock() for name in handles}

    @classmethod
    def create(
        cls,
        settings: Settings,
        *,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        torch_threads: int | None = 1,
        num_cpus_per_actor: float = 1.0,
        max_concurrency: int = 4,
        stop: threading.Event | None = None,
    ) -> RayExpertPool:
        """Start the actors and wait until each is up (blocking).

        Ray must already be initialised by the caller. Raises `PoolStartFailed` when the
        actors cannot all be placed within `settings.actor_start_timeout_s` (the cluster
        lacks the CPUs, GPUs or custom resources they ask for), or when `stop` is set while
        they start (a signal during the server's startup); none is left behind then.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        gpus = ray.cluster_resources().get("GPU", 0)  # type: ignore[no-untyped-call]
        device = actor_device(
            settings.device,
            local_cuda=resolve_device("auto") == "cuda",
            cluster_gpus=gpus,
            local_gpus=local_node_gpus(),
        )
        if device.startswith("cuda") and gpus < 1 and settings.ray_address is None:
            # An embedded Ray never gains a GPU: waiting out the start timeout (60 s) would
            # only end in the same refusal. A cluster may yet (an autoscaler): it waits.
            raise PoolStartFailed(
                reason=f"device {settings.device!r} asks for GPUs, and this machine's Ray "
                "counts none (use --device cpu or auto)"
            )
        count = actor_count(device, settings, gpus)
        if device.startswith("cuda"):
            resources: dict[str, Any] = {"num_gpus": 1, "num_cpus": num_cpus_per_actor}
        else:
            resources = {"num_cpus": num_cpus_per_actor}
        if settings.actor_resource:
            # Each worker node offers one unit (local-cluster.sh, KubeRay): one actor a node.
            resources["resources"] = {settings.actor_resource: 1}
        start_actor: Callable[[str], Any] = functools.partial(
            # Probes on a thread of their own: a probe unanswered means the process is.
            # (Ray's typed overloads of `remote` omit the option; its checks accept it.)
            ray.remote(  # type: ignore[call-overload]
                concurrency_groups={PROBE_GROUP: 1}
            )(ExpertActor).options(
                max_restarts=settings.actor_max_restarts,
                # We retry ourselves so that no group is ever answered twice.
                max_task_retries=0,
                max_concurrency=max_concurrency,
                **resources,
            ).remote,
            device=device,
            budget_bytes=settings.cache_bytes,
            torch_threads=torch_threads,
            cache_policy=settings.cache_policy,
            lookahead=settings.lookahead,
            host_cache_bytes=settings.host_cache_bytes,
        )
        handles = {f"actor-{index}": start_actor(f"actor-{index}") for index in range(count)}
        try:
            up = [handle.get_pid.remote() for handle in handles.values()]
            wait_until_up(up, settings.actor_start_timeout_s, stop)
            ray.get(up)  # raises RayActorError for an actor that died starting
        except StartStopped:
            for handle in handles.values():
                ray.kill(handle, no_restart=True)
            raise PoolStartFailed(reason="a stop was asked for before the actors were up") from None
        except GetTimeoutError:
            # Read before the kills: the actors that were placed still hold theirs, and the
            # total says what the cluster could give at all.
            room = cluster_room()
            for handle in handles.values():
                ray.kill(handle, no_restart=True)
            raise PoolStartFailed(
                reason=f"{count} actor(s) asking {resources} each were not all placed within "
                f"{settings.actor_start_timeout_s:g} s; {room}",
            ) from None
        except RayActorError as exc:
            for handle in handles.values():
                ray.kill(handle, no_restart=True)
            raise PoolStartFailed(
                reason=f"a {device} actor failed to start: {last_line(str(exc))}"
            ) from None
        logger.info(
            "started %s %s actor(s) of %s bytes (%s cache)%s",
            count,
            device,
            settings.cache_bytes,
            settings.cache_policy,
            f", each keeping up to {settings.host_cache_bytes} bytes of expert files in pinned"
            " host memory"
            if settings.host_cache_bytes and device.startswith("cuda")
            else "",
        )
        if settings.host_cache_bytes and not device.startswith("cuda"):
            # The actors say so too, but their logs stay on the Ray nodes (log_to_driver off).
            logger.warning(
                "host_cache_bytes (%s) applies to CUDA actors only; ignored on %s actors",
                settings.host_cache_bytes, device,
            )
        channels = None
        if settings.actor_channel == "socket":
            sweep_stale_folders()
            try:
                channels = make_channel_folder()
            except OSError as exc:  # e.g. a read-only temporary directory
                logger.warning("no folder for actor sockets (%s); batches go as Ray calls", exc)
        context = ray.get_runtime_context()
        return cls(
            handles,
            device=device,
            settings=settings,
            clock=clock,
            sleep=sleep,
            channels=channels,
            node_id=context.get_node_id(),
            gcs_address=_gcs_address(context),
            start_actor=start_actor,
        )

    def handle(self, actor: str) -> Any:
        """The Ray actor handle (for fault-injection tests and tooling)."""
        return self._handles[actor]

    def transport(self, actor: str) -> str:
        """How `run` reaches `actor` now: "socket", "ray", or "unopened" before its first
        call since it (re)started."""
        if actor not in self._channels:
            return "ray" if self._channel_dir is None else "unopened"
        channel = self._channels[actor]
        return "ray" if channel is None else "socket"

    async def _call_run(
        self, actor: str, payload: list[tuple[ExpertRef, np.ndarray]]
    ) -> ActorReply:
        from ray.exceptions import RayActorError

        channel = await self._channel(actor)
        try:
            if channel is not None:
                return await channel.run(payload)
            reply: ActorReply = await self._handles[actor].run.remote(payload)
        except (RayActorError, ChannelClosed) as exc:
            # A restarted actor is a new process: its channel is opened afresh. Only this
            # call's entry goes: Ray may fail an old process's call after the restart, when a
            # newer call has opened the new process's channel.
            if actor in self._channels and self._channels[actor] is channel:
                del self._channels[actor]
            raise ActorDied(actor) from exc
        except ChannelCallFailed as exc:
            raise ActorFailed(actor=actor, reason=str(exc)) from exc
        return reply

    async def _channel(self, actor: str) -> Channel | None:
        """The open channel to `actor`, opening it if need be; None: use Ray's call."""
        if self._channel_dir is None:
            return None
        known = self._channels.get(actor)
        if known is not None and not known.closed:
            return known
        async with self._channel_locks[actor]:
            if actor in self._channels:
                channel = self._channels[actor]
                if channel is None or not channel.closed:
                    return channel
            return await self._open_channel(actor, self._channel_dir)

    async def _open_channel(self, actor: str, folder: Path) -> Channel | None:
        from ray.exceptions import RayActorError

        try:
            opened: tuple[str, str] | None = await self._handles[actor].open_channel.remote(
                str(folder)
            )
        except RayActorError as exc:
            raise ActorDied(actor) from exc
        channel = None
        if opened is None or opened[0] != self._node_id:
            logger.info("actor %s: no socket on this node; its batches go as Ray calls", actor)
        else:
            try:
                channel = await Channel.connect(
                    Path(opened[1]), on_lost=functools.partial(self._channel_lost, actor)
                )
            except OSError as exc:
                logger.warning("actor %s: no channel (%s); using Ray calls", actor, exc)
            else:
                logger.info("actor %s takes its batches over %s", actor, opened[1])
        self._channels[actor] = channel
        return channel

    def _channel_lost(self, actor: str, channel: Channel, reason: str) -> None:
        if self._channels.get(actor) is channel:  # not an older process's channel
            del self._channels[actor]  # a restarted actor is a new process: a new channel
            self._actor_lost(actor, reason)

    async def _kill_hung(self, actor: str) -> None:
        # Its socket first: the calls still waiting on it fail now, and are retried elsewhere,
        # rather than each at its own deadline.
        channel = self._channels.pop(actor, None)
        if channel is not None:
            await channel.close()
        await kill_hung_process(actor, self._handles[actor], clock=self._clock, sleep=self._sleep)

    async def _replace(self, actor: str) -> bool:
        if self._start_actor is None:
            return False
        old = self._handles[actor]

        def adopt(handle: Any) -> None:
            self._handles[actor] = handle  # from now on the pool's close kills it
            self._channels.pop(actor, None)  # the new process opens a channel of its own

        try:
            return await start_in_place(
                actor, self._start_actor, adopt=adopt, timeout_s=self._start_timeout_s
            )
        finally:
            # Its restarts are spent, so it is dead; killed all the same, should Ray not think so.
            await kill_bounded(actor, old)

    async def _call_prefetch(self, actor: str, experts: list[ExpertRef]) -> dict[str, int]:
        from ray.exceptions import RayActorError

        try:
            resident: dict[str, int] = await self._handles[actor].prefetch.remote(experts)
        except RayActorError as exc:
            raise ActorDied(actor) from exc
        return resident

    async def _call_forget_popularity(self, actor: str) -> None:
        from ray.exceptions import RayActorError

        channel = self._channels.get(actor)
        if channel is not None:
            channel.forget_refs()  # a new version went live: the old one's refs are done with
        try:
            await self._handles[actor].forget_popularity.remote()
        except RayActorError as exc:
            raise ActorDied(actor) from exc

    async def _call_info(self, actor: str) -> ActorInfo:
        from ray.exceptions import ActorDiedError, RayError

        try:
            info: ActorInfo = await (
                self._handles[actor].info.options(concurrency_group=PROBE_GROUP).remote()
            )
        except ActorDiedError as exc:
            # Raised to a new call only when Ray will not restart the actor; while it
            # restarts, calls get ActorUnavailableError.
            raise ActorGone(actor) from exc
        except RayError as exc:
            # RayActorError, and whatever else Ray answers a probe with (a lost object, its
            # owner gone, a system error): a failed probe, polled again. Raised out of the
            # revival, it ended it unseen and left the actor marked dead for good.
            raise ActorDied(actor) from exc
        return info

    async def _runtime_problem(self) -> str | None:
        # The GCS is what every actor call and restart goes through: when it takes no TCP
        # connection, Ray's calls hang until Ray ends this process (60 s).
        if self._gcs_address is None:
            return None
        host, _, port = self._gcs_address.rpartition(":")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), _GCS_PROBE_S
            )
        except (OSError, TimeoutError, ValueError) as exc:
            why = str(exc) or type(exc).__name__
            return f"the Ray cluster does not answer (its GCS at {self._gcs_address}: {why})"
        writer.close()
        return None

    async def _shutdown(self) -> None:
        import ray

        # Taken and cleared first: a call in flight wakes on its channel's close and drops
        # its entry, which changed the dict under the loop (RuntimeError; actors not killed).
        channels = [channel for channel in self._channels.values() if channel is not None]
        self._channels.clear()
        handles = list(self._handles.values())
        channel_dir = self._channel_dir

        def kill_and_remove() -> None:
            # Off the event loop: a kill is a call to Ray's GCS, the removal file I/O.
            for handle in handles:
                ray.kill(handle, no_restart=True)
            if channel_dir is not None:
                shutil.rmtree(channel_dir, ignore_errors=True)

        try:
            for channel in channels:
                await channel.close()
        finally:
            await in_daemon_thread(kill_and_remove)
