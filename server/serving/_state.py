"""What the app's lifespan owns: the actor pool (for the server's lifetime) and the store
version(s) it serves, with the store watcher and the hot swap.

The pool is built once at start. A new store version is data: `swap()` reads the version on
disk first and returns at once when it is the one served; otherwise it opens the new store
and router (no actor is created, restarted or re-opened) and makes it current. Requests that
entered the old version finish on it; then its batcher is closed. Blocking reads of the store
run on daemon threads, so a read stuck on a bad file system never holds up shutdown.
How the pool is made and what a version's batcher sees of it: _pool.py; the reads and opens
that run on those threads: _open.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from experts_store import Clock
from server._exceptions import NotReady
from server._settings import Settings
from server.batching import OpenConnections, RouteRunner
from server.kinds import check_kind_budget
from server.pool import ExpertPool, in_daemon_thread
from server.serving._collect import thaw
from server.serving._open import (
    SWAP_FREEZE_FROM_OBJECTS,
    background_pacer,
    read_on_disk,
)

# Bound here by this name: tests replace it to hold, fail or count a swap's opens.
from server.serving._open import open_version_files as _open_version_files
from server.serving._pool import ObservedPool, PoolFactory, ray_pool
from server.serving._version import (
    BatcherFactory,
    StoreVersion,
    StoreVersionReader,
    default_batcher,
)

__all__ = ["ServingState", "in_daemon_thread"]

logger = logging.getLogger(__name__)

# Closing the pool kills its actors; past this the server goes down without waiting further.
_CLOSE_TIMEOUT_S = 3.0
# The longest wait before the watcher tries a store version it refused again.
_MAX_WATCH_BACKOFF_S = 300.0
# How long a swap waits for the actors to reset their popularity counts: a busy or stuck actor
# must not keep a new version from going live (it only admits the new experts more slowly).
_FORGET_TIMEOUT_S = 2.0


def _capacity(version: StoreVersion, budget_bytes: int) -> str:
    """The start-up line's account of the store against one actor's cache."""
    manifest = version.manifest
    total, count = manifest.total_expert_bytes, len(manifest.experts)
    text = (f"kind {version.model.kind}, {manifest.num_experts} experts, "
            f"{total / 2**20:.1f} MiB of expert files")
    if count and total:
        held = min(count, budget_bytes * count // total)
        text += (f"; each actor's cache of {budget_bytes / 2**20:.1f} MiB holds about {held}"
                 f" of the {count} files")
    return text


class ServingState:
    """The resources of one app, built by `start()` and released by `stop()`."""

    def __init__(
        self,
        *,
        settings: Settings,
        clock: Clock,
        pool_factory: PoolFactory | None = None,
        batcher_factory: BatcherFactory | None = None,
        on_batch: Callable[[int], None] | None = None,
        on_generated: Callable[[int], None] | None = None,
        open_connections: OpenConnections | None = None,
    ) -> None:
        self.settings = settings
        self._on_generated = on_generated
        self.clock = clock
        self.pool_factory: PoolFactory = pool_factory or ray_pool()
        self.batcher_factory: BatcherFactory = batcher_factory or functools.partial(
            default_batcher, open_connections=open_connections,
            queued_elsewhere=self._queued_beside,
        )
        self._on_batch = on_batch or (lambda rows: None)
        self.pool: ExpertPool | None = None
        self.version: StoreVersion | None = None
        self.stopping = False
        # Set when a stop with a drain window began (`momlp serve --drain-s`): the probes
        # say not ready while requests are still answered, so load balancers move away.
        self.draining = False
        self._watcher: asyncio.Task[None] | None = None
        self._swapping: asyncio.Task[StoreVersion | None] | None = None
        # Each caller's swap (`swap()`), kept here so that a caller cancelled while it waits
        # (a reload's timeout) does not cancel the swap it asked for.
        self._swap_calls: set[asyncio.Task[bool]] = set()
        self._retiring: set[asyncio.Task[None]] = set()
        # Versions replaced and not yet closed: a stop closes them (their batches end) before
        # the pool, whether or not their retire got that far.
        self._unclosed: list[StoreVersion] = []
        # The on-disk version the last swap opened (the one a failed swap concerns).
        self._tried: str | None = None
        # The on-disk version the store watcher refuses ("" for a missing manifest), for
        # /metrics: a publish that never goes live is otherwise seen only in the log.
        self.refused_version: str | None = None
        self._version_on_disk = StoreVersionReader(Path(settings.store))
        # Replaceable so that tests drive the store watcher without waiting.
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    async def start(self) -> None:
        self.stopping = False
        made = self.pool_factory(self.settings)
        self.pool = await made if inspect.isawaitable(made) else made
        try:
            self.version = await self._open_version(beside_serving=False)
        except BaseException:
            await self._close_pool()
            raise
        logger.info("serving store %s version %s: %s", self.settings.store,
                    self.version.version, _capacity(self.version, self.pool.budget_bytes))
        if self.settings.watch_store:
            self._watcher = asyncio.create_task(self._watch(), name="momlp-store-watcher")

    async def stop(self) -> None:
        """Release everything within a few seconds, whatever is in flight."""
        self.stopping = True
        tasks = [t for t in (self._watcher, self._swapping, *self._swap_calls, *self._retiring)
                 if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        version, self.version = self.version, None
        replaced, self._unclosed = self._unclosed, []
        try:
            for old in replaced:
                await old.close()
            if version is not None:
                await version.close()
        finally:
            await self._close_pool()
            thaw()

    async def _close_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is None:
            return
        try:
            await asyncio.wait_for(pool.close(), _CLOSE_TIMEOUT_S)
        except TimeoutError:
            logger.error("the actor pool did not close within %s s", _CLOSE_TIMEOUT_S)

    async def _open_version(self, *, beside_serving: bool) -> StoreVersion:
        """Open the store on disk. `beside_serving` (a swap): at a pace, and freezing what it
        made only when that is many objects; the start, with nothing served yet, does neither
        pace nor spare its freeze."""
        pool = self.pool
        if pool is None:
            raise NotReady(reason="the actor pool is not up")
        pace, freeze_from = (
            (background_pacer(), SWAP_FREEZE_FROM_OBJECTS) if beside_serving else (None, 0)
        )
        served = self.version.store if beside_serving and self.version is not None else None
        store, model = await in_daemon_thread(
            _open_version_files,
            Path(self.settings.store),
            pool.budget_bytes,
            pace,
            freeze_from,
            served,
            self._note_tried,
        )
        check_kind_budget(model, pool.budget_bytes)
        observed = ObservedPool(pool, self._on_batch, self._on_generated)
        batcher = self.batcher_factory(model, observed, self.settings, self.clock)
        route_runner = RouteRunner.for_settings(model.route, self.settings)
        return StoreVersion(store, model, batcher, route_runner)

    def _note_tried(self, version: str) -> None:
        # From the opening thread: the swap's read of the version may predate a publish.
        self._tried = version

    def current(self) -> StoreVersion:
        version = self.version
        if version is None or self.stopping:
            raise NotReady(reason="the store and the pool are not up")
        return version

    def _queued_beside(self, batcher: object) -> int:
        """Rows the open versions other than `batcher`'s hold, which its admission counts
        against `max_queue_rows`: else a swap admitted up to twice the limit. Not `batcher`'s
        own: a request that entered a replaced version (its body arrived after the swap) read
        that version's rows twice and was refused with the server's queue half empty."""
        if not self._unclosed:  # between swaps, on every request: one version, the asker's
            return 0
        current = self.version
        return sum(
            version.batcher.queued_rows
            for version in (*self._unclosed, *(() if current is None else (current,)))
            if version.batcher is not batcher
        )

    @property
    def queued_rows(self) -> int:
        """Rows admitted and not yet computed, in every version still open: a request keeps
        the version it entered, so after a swap the replaced version's batcher still holds
        rows until they are answered (the metrics' `momlp_queue_rows`)."""
        versions = [*self._unclosed, *([self.version] if self.version is not None else [])]
        return sum(version.batcher.queued_rows for version in versions)

    def check_ready(self) -> StoreVersion:
        """The version served when the readiness probes should say ready; NotReady (503)
        saying why not: not up yet, stopping or draining, or no live actor."""
        version = self.current()
        if self.draining:
            raise NotReady(reason="draining: the server is stopping")
        actors = self.pool.actors() if self.pool is not None else []
        if actors and not any(actor.alive for actor in actors):
            # Restarting, or out of restarts until replaced: either way nothing can be answered.
            raise NotReady(reason="no live actor in the pool")
        return version

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[StoreVersion]:
        """The current version, kept open until the caller is done with it."""
        version = self.current()
        version.in_flight += 1
        version.drained.clear()
        try:
            yield version
        finally:
            version.in_flight -= 1
            if version.in_flight == 0:
                version.drained.set()

    async def swap(self) -> bool:
        """Make the store on disk current if its version is new; False if it is the one served.

        Concurrent callers (the watcher, admin reloads) share one swap, but only one that
        began after they called: a swap already running may have read manifest.json before
        a publish its caller made, so it is waited out and the disk is read again. A caller
        cancelled meanwhile (a reload past its timeout) leaves that to go on.
        """
        task = asyncio.create_task(self._swap_after_running(), name="momlp-swap-call")
        self._swap_calls.add(task)
        task.add_done_callback(self._swap_calls.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Its caller has left (a reload answered 504, "it goes on"): if it fails, the log
            # is the only place that says so.
            task.add_done_callback(_log_if_failed)
            raise

    async def _swap_after_running(self) -> bool:
        swapped = False
        running = self._swapping
        if running is not None and not running.done():
            try:
                swapped = await asyncio.shield(running) is not None
            except Exception:  # that swap's version failed; the one read next decides
                pass
        task = self._swapping
        if task is None or task.done():
            task = self._swapping = asyncio.create_task(self._swap(), name="momlp-swap")
        old = await asyncio.shield(task)
        return swapped or old is not None

    async def reload(self) -> bool:
        """`swap()`, then wait until the replaced version's requests have finished."""
        version = self.version
        swapped = await self.swap()
        if swapped and version is not None:
            await self._drain(version)
        return swapped

    async def _swap(self) -> StoreVersion | None:
        old = self.version
        if old is None or self.stopping:
            return None
        on_disk = await in_daemon_thread(read_on_disk, self._version_on_disk, background_pacer())
        self._tried = on_disk
        if on_disk == old.version:
            return None
        new = await self._open_version(beside_serving=True)
        if new.version == old.version or self.stopping:
            await new.close()
            return None
        self.version = new
        self._unclosed.append(old)
        logger.info("store version %s replaces %s", new.version, old.version)
        if self.pool is not None:
            try:
                await asyncio.wait_for(self.pool.forget_popularity(), _FORGET_TIMEOUT_S)
            except TimeoutError:
                logger.warning(
                    "actors did not reset their popularity counts within %s s; the new "
                    "version's experts may be admitted more slowly", _FORGET_TIMEOUT_S,
                )
        task = asyncio.create_task(self._retire(old), name="momlp-retire")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return old

    async def _drain(self, old: StoreVersion) -> None:
        if old.in_flight:
            # A request holds its version while its body arrives and while it is answered:
            # up to both timeouts (a slow upload that entered before the swap was answered
            # 503 "pool shut down" when only the answer's was waited for).
            hold_s = self.settings.body_timeout_s + self.settings.request_timeout_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(old.drained.wait(), hold_s)

    async def _retire(self, old: StoreVersion) -> None:
        # Requests that entered the old version finish on it; then its batcher is closed.
        await self._drain(old)
        await old.close()
        self._unclosed = [v for v in self._unclosed if v is not old]
        if old.in_flight == 0:
            # Freed at once, its per-expert objects would be ~0.1 s of the event loop at
            # K=100,000; a request still in it (past its drain) keeps it whole instead.
            await in_daemon_thread(old.release, background_pacer())

    async def _watch(self) -> None:
        interval = self.settings.watch_interval_s
        # The on-disk version the last reload refused, and when to try it again: a broken
        # version is logged once and retried less and less often (a file may be fixed in
        # place), while a newly published one is tried at the next poll.
        refused: list[str | None] = []  # empty, or the one version refused (None: no manifest)
        backoff = retry_at = 0.0
        while True:
            await self.sleep(interval)
            if self.version is None:
                continue
            try:
                if refused:
                    # Only while a version is refused: a healthy poll reads the manifest once.
                    on_disk = await in_daemon_thread(
                        read_on_disk, self._version_on_disk, background_pacer()
                    )
                    if refused == [on_disk] and self.clock.now() < retry_at:
                        continue
                await self.swap()
            except Exception as exc:
                # A half-written or broken new store must not take the serving one down.
                on_disk = self._tried
                if refused != [on_disk]:
                    logger.error(
                        "reloading store version %s failed (version %s keeps serving): %s",
                        on_disk, self.version.version if self.version else None, exc,
                    )
                    backoff = interval
                else:
                    logger.debug("reloading store version %s failed again: %s", on_disk, exc)
                    backoff = min(2.0 * backoff, _MAX_WATCH_BACKOFF_S)
                refused, retry_at = [on_disk], self.clock.now() + backoff
                self.refused_version = on_disk or ""
            else:
                refused = []
                self.refused_version = None


def _log_if_failed(task: asyncio.Task[bool]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("a store swap whose caller left failed: %s", task.exception())
