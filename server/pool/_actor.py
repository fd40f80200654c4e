"""One device's worth of serving: an expert cache plus the forward passes, with and without Ray.

`ActorCore` is the plain-Python logic (tested without Ray and used in-process by the fake pool);
`ExpertActor` is the body of the Ray actor, a thin wrapper that owns one `ActorCore`. An
expert's forward pass is `_forward`'s; the hypernetworks an actor pins, `_pins`'.

An actor belongs to the server, not to a store version: it opens no store. Each call names
its experts by `ExpertRef` (the file and its content hash), and the cache is keyed by content,
so experts unchanged between two versions stay resident across a swap and the versions share
one budget without counting anything twice.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experts_store import (
    CacheBusy,
    CacheError,
    CachePolicy,
    Clock,
    ExpertCache,
    ExpertLoadError,
    ExpertRef,
    FrozenExpert,
    GeneratedRef,
    MonotonicClock,
    StoreError,
)
from server.pool._channel import ChannelServer
from server.pool._device import resolve_device, row_block
from server.pool._forward import DeviceForward
from server.pool._loader import Cached, DeviceLoader, load_error, store_relative
from server.pool._pins import GeneratorPins
from server.pool._types import ActorInfo, ActorReply, CacheCounts, GroupOutcome
from server.pool._vram import ActivationMeter, CudaCounters, DeviceQuiet

__all__ = ["ActorCore", "ExpertActor"]

logger = logging.getLogger(__name__)

ERROR_LOAD = "load"
ERROR_BUSY = "busy"
ERROR_INTERNAL = "internal"


class ActorCore:
    """Runs groups of rows through their experts on one device, loading misses on demand.

    Calls to `run` are serialised (the device computes one expert at a time, which is what
    the per-request VRAM figure assumes). With `lookahead` (default: on for CUDA), while one
    group computes, the next group's expert is leased (loaded if missing) on a helper thread,
    so a copy over PCIe overlaps a compute. On CPU a load is CPU work the run would do anyway,
    and each hand-off to the helper thread costs a wake-up and a GIL switch: off by default
    (benchmarks/RESULTS.md, "look-ahead on CPU").
    `prefetch` may run concurrently and only warms the cache. `host_cache_bytes` > 0 keeps
    the files of loaded experts in pinned host memory up to that many bytes, so that a CUDA
    miss on one of them is a copy, not a read (`experts_store.HostTier`); CPU actors ignore it.
    """

    def __init__(
        self,
        *,
        name: str,
        device: str = "cpu",
        budget_bytes: int,
        cache_policy: CachePolicy = "tinylfu",
        clock: Clock | None = None,
        lease_timeout_s: float = 30.0,
        lookahead: bool | None = None,
        host_cache_bytes: int = 0,
        rows_per_block: int | None = None,
    ) -> None:
        self.name = name
        # Names this process in its replies: the pool tells from it a reply of a new process
        # (whose counts start from 0) from a late one of the process it knows.
        self.process = secrets.token_hex(8)
        self.device = resolve_device(device)
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._lease_timeout_s = lease_timeout_s
        if host_cache_bytes and not self.device.startswith("cuda"):
            # `auto` may land on CPU with settings meant for a GPU machine: serve, but say so.
            logger.warning(
                "actor %s: host_cache_bytes applies to CUDA actors only; ignored on %s",
                name,
                self.device,
            )
            host_cache_bytes = 0
        self._loader = DeviceLoader(self.device, host_cache_bytes)
        self._cuda = self.device.startswith("cuda")
        # CUDA: activation bytes per block shape from the allocator's counters, read while no
        # other thread of this actor loads or evicts (`_vram`); CPU: from tensor sizes.
        quiet = DeviceQuiet() if self._cuda else None
        meter = ActivationMeter(CudaCounters(self.device), quiet) if quiet is not None else None
        # Another block size only for measuring one against the default
        # (benchmarks/cuda_row_block.py); a row's bits may then depend on its batch.
        block = rows_per_block or row_block(self.device)
        # The helpers' bound methods are kept (`_pin` too): called per group, they cost what
        # this class's own methods would.
        self._forward = DeviceForward(self.device, block, meter).run
        # Held by whatever may allocate or free device memory beside the forward: a lease (it
        # may load or evict, on the look-ahead's thread too) and a prefetch.
        self._using_device: Callable[[], AbstractContextManager[Any]] = (
            quiet.shared if quiet is not None else nullcontext
        )
        self._cache: ExpertCache[Cached] = ExpertCache(
            budget_bytes, self._loader, clock=self._clock, policy=cache_policy
        )
        # Hypernetworks this actor generates with (`_pins`).
        self._pins = GeneratorPins(self._cache, self._loader, lease_timeout_s)
        self._pin = self._pins.pin
        self._compute_lock = threading.Lock()
        # The groups of each run call that arrived and has not finished: a prefetch never evicts
        # their experts. One entry per call (a prefetch, which is rare, gathers the experts; a
        # run adds and removes its entry instead of counting every expert in and out).
        self._wanted: dict[int, Sequence[tuple[ExpertRef, np.ndarray]]] = {}
        self._calls = itertools.count()
        self._wanted_lock = threading.Lock()
        if lookahead is None:
            lookahead = self._cuda
        self._lookahead = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-lease")
            if lookahead
            else None
        )

    @property
    def cache(self) -> ExpertCache[Cached]:
        return self._cache

    @property
    def lookahead(self) -> bool:
        """Whether the next group's expert is leased on a helper thread during a compute."""
        return self._lookahead is not None

    def close(self) -> None:
        if self._lookahead is not None:
            self._lookahead.shutdown(wait=True)

    def pinned(self) -> list[str]:
        """The sha256 of each hypernetwork pinned now, least recently used first."""
        return self._pins.pinned()

    def run(self, groups: Sequence[tuple[ExpertRef, np.ndarray]]) -> ActorReply:
        """Forward each (expert, rows [m, n] float32) group; one outcome per group, in order."""
        with self._wanted_lock:
            token = next(self._calls)
            self._wanted[token] = groups
        try:
            with self._compute_lock:
                outcomes = self._run_locked(groups)
        finally:
            with self._wanted_lock:
                del self._wanted[token]
        return ActorReply(
            actor=self.name,
            results=outcomes,
            device_bytes=self._cache.resident_bytes,
            resident=self.resident(),
            counts=self.counts(),
            process=self.process,
        )

    def counts(self) -> CacheCounts:
        stats = self._cache.stats
        return CacheCounts(
            evictions=stats.evictions, loads=stats.loads, load_bytes=stats.bytes_loaded
        )

    def resident(self) -> dict[str, int]:
        """Content hash -> bytes of every expert loaded in this actor's cache."""
        return {_content(key): nbytes for key, nbytes in self._cache.resident().items()}

    def _run_locked(self, groups: Sequence[tuple[ExpertRef, np.ndarray]]) -> list[GroupOutcome]:
        # Only a miss is worth a helper thread: a hit's lease takes microseconds, and handing
        # work to a thread costs more than that on a busy machine.
        ahead = self._lookahead
        # Only the look-ahead asks what is resident (a scan of the cache, per call).
        resident = self._cache.resident() if ahead is not None else {}
        outcomes: list[GroupOutcome] = []
        pending: Future[_Leased] | None = None
        # One inference_mode for the call, not one per group (~1.5 µs each).
        with torch.inference_mode():
            try:
                for index, (ref, rows) in enumerate(groups):
                    if pending is not None:
                        leased = pending.result()
                        pending = None
                    else:
                        leased = self._open_lease(ref)
                    following = groups[index + 1][0] if index + 1 < len(groups) else None
                    if ahead is not None and following is not None and following not in resident:
                        pending = ahead.submit(self._open_lease, following)
                    outcomes.append(self._compute(ref, rows, leased))
            finally:
                if pending is not None:
                    pending.result().release()
        return outcomes

    def _open_lease(self, ref: ExpertRef) -> _Leased:
        try:
            with self._using_device():
                if isinstance(ref, GeneratedRef):
                    self._pin(ref.generator)
                manager = self._cache.lease(ref, timeout=self._lease_timeout_s)
                lease = manager.__enter__()
        except ExpertLoadError as exc:
            logger.warning("actor %s cannot load expert %s: %s", self.name, ref.expert_id, exc)
            return _Leased(None, None, ERROR_LOAD, load_error(ref, exc))
        except CacheBusy as exc:
            return _Leased(None, None, ERROR_BUSY, store_relative(ref, str(exc)))
        except (CacheError, StoreError) as exc:
            return _Leased(None, None, ERROR_LOAD, store_relative(ref, str(exc)))
        except Exception as exc:
            # A file no check foresaw (a loader's own error): this expert's rows fail with a
            # load error naming it; left to escape, it failed every group of the call.
            logger.exception("actor %s: loading expert %s failed", self.name, ref.expert_id)
            what = f"expert {ref.expert_id} could not be loaded: {type(exc).__name__}: {exc}"
            return _Leased(None, None, ERROR_LOAD, store_relative(ref, what))
        return _Leased(manager, lease, None, None)

    def _compute(self, ref: ExpertRef, rows: np.ndarray, leased: _Leased) -> GroupOutcome:
        expert_id = ref.expert_id
        generated = isinstance(ref, GeneratedRef)
        key = ref.sha256 if generated else None
        if leased.lease is None:
            return GroupOutcome(
                expert_id=expert_id,
                outputs=None,
                error=leased.error,
                error_kind=leased.error_kind,
                key=key,
            )
        try:
            module = leased.lease.value
            if not isinstance(module, FrozenExpert):
                raise TypeError(f"key {ref.sha256[:16]} names a hypernetwork, not an expert")
            start = self._clock.now()
            outputs, activation = self._forward(module, rows)
            compute_ms = (self._clock.now() - start) * 1000.0
            return GroupOutcome(
                expert_id=expert_id,
                outputs=outputs,
                hit=bool(leased.lease.hit),
                load_ms=float(leased.lease.load_seconds) * 1000.0,
                compute_ms=compute_ms,
                expert_bytes=int(leased.lease.nbytes),
                activation_bytes=activation,
                key=key,
                generator_bytes=ref.generator.nbytes if isinstance(ref, GeneratedRef) else 0,
            )
        except Exception as exc:  # one bad group must not fail the other groups of the call
            logger.exception("actor %s: expert %s failed to compute", self.name, expert_id)
            return GroupOutcome(
                expert_id=expert_id, outputs=None, error=repr(exc), error_kind=ERROR_INTERNAL
            )
        finally:
            leased.release()

    def prefetch(self, experts: Sequence[ExpertRef]) -> dict[str, int]:
        """Start loading these experts so a later run finds them; returns what is resident.

        The cache makes room by its policy but never evicts an expert that an arrived run
        call needs, one in this prefetch, or a leased one. An expert that does not fit that way
        is skipped: the run will load it on demand.
        """
        with self._wanted_lock:
            keep = set(experts) | {ref for run in self._wanted.values() for ref, _ in run}
        for ref in experts:
            try:
                with self._using_device():
                    if isinstance(ref, GeneratedRef):
                        self._pin(ref.generator)
                    self._cache.prefetch(ref, keep=keep)
            except (StoreError, CacheError) as exc:
                # The failure is reported by the run that needs the expert.
                logger.info("actor %s: prefetch of %s failed: %s", self.name, ref.expert_id, exc)
        return self.resident()

    def forget_popularity(self) -> None:
        """A new store version went live (`ExpertCache.forget_popularity`); the hypernetworks
        pinned so far are released too.

        Kept, an old version's f held its share of the budget for good after a swap (to
        another kind, or to a new f), and with two pinned a tight budget had no room left for
        the new version's experts: every request waited out the lease timeout (503). Each f
        in use is pinned again by its next generation, a cache hit while it is resident.
        """
        self._cache.forget_popularity()
        self._pins.release()

    def info(self) -> ActorInfo:
        resident = self.resident()
        return ActorInfo(
            name=self.name,
            device=self.device,
            resident_bytes=sum(resident.values()),
            budget_bytes=self._cache.budget_bytes,
            resident=sorted(resident),
            alive=True,
            counts=self.counts(),
            process=self.process,
        )


def _content(key: object) -> str:
    # Files, hypernetworks and generated θ alike: their `sha256` is the cache key.
    return key.sha256 if isinstance(key, ExpertRef) else str(key)


@dataclass
class _Leased:
    """A lease opened on the helper thread, or why it could not be opened."""

    manager: AbstractContextManager[Any] | None
    lease: Any
    error_kind: str | None
    error: str | None

    def release(self) -> None:
        if self.manager is not None:
            manager, self.manager = self.manager, None
            manager.__exit__(None, None, None)


class ExpertActor:
    """Body of the Ray actor (wrapped with `ray.remote` by the pool): one per device."""

    def __init__(
        self,
        name: str,
        device: str,
        budget_bytes: int,
        torch_threads: int | None = None,
        cache_policy: CachePolicy = "tinylfu",
        lookahead: bool | None = None,
        host_cache_bytes: int = 0,
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self._core = ActorCore(
            name=name,
            device=device,
            budget_bytes=budget_bytes,
            cache_policy=cache_policy,
            lookahead=lookahead,
            host_cache_bytes=host_cache_bytes,
        )
        self._channel: ChannelServer | None = None

    def run(self, groups: list[tuple[ExpertRef, np.ndarray]]) -> ActorReply:
        return self._core.run(groups)

    def open_channel(self, directory: str) -> tuple[str, str] | None:
        """Answer `run` on a Unix socket in `directory` too (`_channel`); returns (this
        actor's Ray node id, the socket's path), or None where the directory is not on this
        node or the path is too long for a socket (the caller then keeps to Ray calls)."""
        import ray

        if self._channel is None:
            folder = Path(directory)
            if not folder.is_dir():
                return None
            path = folder / f"{self._core.name}-{os.getpid()}.sock"
            # A killed predecessor never removed its socket: one stale file a restart, for
            # as long as the server runs. None of them is dialled again (the server asks
            # each new process for its own path).
            for stale in folder.glob(f"{self._core.name}-*.sock"):
                if stale.name.removeprefix(f"{self._core.name}-")[:-5].isdigit():
                    stale.unlink(missing_ok=True)
            try:
                self._channel = ChannelServer(path, self._core.run)
            except (OSError, ValueError) as exc:
                logger.warning("no channel for %s: %s", self._core.name, exc)
                return None
        node = ray.get_runtime_context().get_node_id()
        return node, os.fspath(self._channel.path)

    def prefetch(self, experts: list[ExpertRef]) -> dict[str, int]:
        return self._core.prefetch(experts)

    def forget_popularity(self) -> None:
        self._core.forget_popularity()

    def info(self) -> ActorInfo:
        return self._core.info()

    def get_pid(self) -> int:
        return os.getpid()
