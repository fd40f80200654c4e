"""Run the app under uvicorn: Ray up first, the URL logged when ready, clean exit on a signal.

uvicorn's graceful shutdown lets in-flight requests finish (each is bounded by
`request_timeout_s`), then the lifespan closes the pool; Ray is shut down last, and only if
this process started (or connected) it (`server.pool.ray_session`). So a SIGTERM stops the
server within `request_timeout_s` plus a few seconds, whatever is in flight, after the drain
window (`drain_s`, `server._drain`) when one is set.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from server._connections import ClosedConnectionLog, guarded_protocol
from server._drain import DrainWindow
from server._settings import Settings
from server.batching import OpenConnections

if TYPE_CHECKING:
    import uvicorn

__all__ = [
    "StopSignals",
    "connection_cap",
    "count_connections",
    "freeze_heap",
    "open_without_key",
    "request_ids_in_access_log",
    "run_server",
    "uvicorn_config",
]

logger = logging.getLogger(__name__)


def freeze_heap() -> int:
    """Collect garbage, then move every object still alive out of the cyclic GC's reach;
    returns how many objects are frozen.

    A started server holds a large heap that lives as long as it does (torch, Ray, the app,
    the first store version). Python's full collections traverse all of it: under load one
    came every few seconds and paused the event loop 140-170 ms, which is where the
    benchmark's occasional ~200 ms p99 came from; after a freeze they take 2-4 ms
    (benchmarks/RESULTS.md, "full collections"). What the first store version leaves behind
    in reference cycles when it is swapped out stays frozen: a bounded, one-time cost.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def open_without_key(settings: Settings) -> bool:
    """True when the server will answer beyond this machine with no API key asked for (a
    blank key is none: the key check takes it so)."""
    from server.http import bearer_key, is_loopback

    if bearer_key(settings.api_key) is not None:
        return False

    return not (settings.host == "localhost" or is_loopback(settings.host))


def _bound_url(server: Any, settings: Settings) -> str:
    for srv in getattr(server, "servers", []):
        for sock in getattr(srv, "sockets", []):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                host, port = sock.getsockname()[:2]
                if sock.family == socket.AF_INET6:
                    host = f"[{host}]"
                return f"http://{host}:{port}"
    return f"http://{settings.host}:{settings.port}"


def _nofile_soft_limit() -> int:
    """The soft limit on open file descriptors; 0 where there is none or it is unknown."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 0 if soft == resource.RLIM_INFINITY else int(soft)


def uvicorn_config(app: Any, settings: Settings) -> uvicorn.Config:
    """How `run_server` runs uvicorn: bound and logging as `settings` say."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=_guarded_protocol(app, settings),
        log_config=None,
        access_log=settings.access_log,
        lifespan="on",
        # Requests end by request_timeout_s on their own; past it, nothing is worth waiting for.
        timeout_graceful_shutdown=max(1, math.ceil(settings.request_timeout_s)),
    )


@contextlib.contextmanager
def request_ids_in_access_log() -> Iterator[None]:
    """While inside, each access log line ends with its request's id (`X-Request-ID`)."""
    from server.http import RequestIdLogFilter

    access = logging.getLogger("uvicorn.access")
    tagging = RequestIdLogFilter()
    access.addFilter(tagging)
    try:
        yield
    finally:
        access.removeFilter(tagging)


def connection_cap(wanted: int, nofile: Callable[[], int] = _nofile_soft_limit) -> int:
    """`wanted`, or half the process's file-descriptor limit where that is lower: the other
    half is left to Ray, the actors' channels and the store's files."""
    limit = nofile()
    if limit <= 0 or wanted <= limit // 2:
        return wanted
    cap = max(1, limit // 2)
    logger.warning(
        "max_connections %s is more than half of this process's file-descriptor limit (%s):"
        " at most %s connections are kept open; raise the limit (ulimit -n) to keep more",
        wanted,
        limit,
        cap,
    )
    return cap


def _guarded_protocol(app: Any, settings: Settings) -> type[Any]:
    """uvicorn's protocol with the header deadline and the connection cap; what they close is
    logged, and counted in a momlp app's metrics. A lost connection ends its request's wait
    for an answer (`server.http.client_gone`)."""
    from server.http import client_gone

    metrics = getattr(getattr(app, "state", None), "metrics", None)
    observe = getattr(metrics, "observe_closed_connection", None)
    cap = connection_cap(settings.max_connections)
    log = ClosedConnectionLog(
        header_timeout_s=settings.header_timeout_s,
        max_connections=cap,
        count=observe if callable(observe) else (lambda _reason: None),
    )
    return guarded_protocol(
        header_timeout_s=settings.header_timeout_s, max_connections=cap, on_close=log,
        on_lost=client_gone,
    )


def count_connections(app: Any, server: uvicorn.Server) -> None:
    """Let a momlp app's batch windows see how many connections `server` holds open
    (`server.batching.OpenConnections`); other apps are left alone."""
    connections = getattr(getattr(app, "state", None), "connections", None)
    if isinstance(connections, OpenConnections):
        # uvicorn's own set of open connections, the one its limit_concurrency counts.
        connections.attach(lambda: len(server.server_state.connections))


class StopSignals:
    """SIGINT and SIGTERM for the whole of `run_server`, from before Ray starts.

    The first one asks whatever is starting or serving to stop: the pool's start stops
    waiting for its actors (`event`), and uvicorn skips serving. Before, a signal between
    `ray.init` and uvicorn's own handlers was only remembered, and one while the actors
    started waited for them, minutes where they could not be placed (benchmarks/RESULTS.md,
    "Forty-ninth session"). Inside `ray.init` Ray's handlers have the signal: its Python one
    exits (code 15, which run_server counts as a stop), its C++ crash reporter, once Ray's
    core worker is up, aborts.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.event = threading.Event()
        self._on_stop: list[Callable[[], None]] = []
        self._previous: dict[int, Any] = {}

    def handle(self, sig: int, _frame: FrameType | None) -> None:
        self.event.set()
        for ask in self._on_stop:
            ask()

    def on_stop(self, ask: Callable[[], None]) -> None:
        """Call `ask` at the first signal, or now if one came already."""
        self._on_stop.append(ask)
        if self.event.is_set():
            ask()

    def install(self) -> None:
        """(Re)take both signals; ray.init puts its own SIGTERM handlers in (a Python one
        that exits from wherever the main thread is, and its C++ crash reporter's)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self.handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _StopIsNotAnError(logging.Filter):
    """Logs uvicorn's reports of a failed start at INFO once a stop was asked for.

    A stop during startup ends the pool's start, which fails uvicorn's lifespan, and uvicorn
    reports that at ERROR ("cannot serve ...", "Application startup failed"). Asked for, it
    is no error: log alerts should not fire on a Ctrl-C. Records logged before the stop keep
    their level.
    """

    def __init__(self, stop: threading.Event, server: uvicorn.Server) -> None:
        super().__init__()
        self._stop = stop
        self._server = server

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and self._stop.is_set() and not self._server.started:
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def run_server(settings: Settings, *, app_factory: Callable[[Settings], Any] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; 0 after a clean shutdown (also one asked for while still
    starting), 1 if startup failed."""
    from server.pool import ray_session

    if open_without_key(settings):
        logger.warning(
            "serving on %s with no API key: anyone who can reach this port can call the "
            "model (only reloads stay limited to this machine); set MOMLP_API_KEY or pass "
            "--api-key-env VAR",
            settings.host,
        )
    problem = bind_problem(settings.host, settings.port)
    if problem is not None:
        # Found now, not after Ray, the actors and the store are up (seconds; minutes on GPUs).
        logger.error("cannot serve on %s:%s: %s", settings.host, settings.port, problem)
        return 1
    stop = StopSignals()
    stop.install()
    try:
        with ray_session(address=settings.ray_address, num_cpus=settings.ray_num_cpus):
            stop.install()
            if stop.event.is_set():
                return _stopped_while_starting()
            return _serve(settings, app_factory, stop)
    except SystemExit as exc:
        # Ray's own SIGTERM handler, in place while ray.init ran (until install() above took
        # the signal back), exits with the signal's number.
        if exc.code != signal.SIGTERM:
            raise
        return _stopped_while_starting()
    finally:
        stop.restore()


def bind_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not bind (host, port) now (the port in use, an address this machine
    lacks), or None. Bound as uvicorn binds (SO_REUSEADDR) and closed at once."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _stopped_while_starting() -> int:
    """A stop asked for during startup is a clean exit, not a failed start."""
    logger.info("momlp stopped before it was ready")
    return 0


def _start_draining(app: Any, settings: Settings) -> None:
    serving = getattr(getattr(app, "state", None), "serving", None)
    if serving is not None:
        serving.draining = True
    logger.info(
        "draining: the readiness probes answer 503 and requests are still served for %g s,"
        " then momlp stops (a second signal stops it now)",
        settings.drain_s,
    )


def _serve(
    settings: Settings, app_factory: Callable[[Settings], Any] | None, stop: StopSignals
) -> int:
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from server.http import create_app
    from server.serving import ray_pool

    app = (
        app_factory(settings)
        if app_factory
        else create_app(settings, pool_factory=ray_pool(stop.event))
    )

    drain = DrainWindow(settings.drain_s, functools.partial(_start_draining, app, settings))

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                if settings.gc_freeze:
                    frozen = freeze_heap()
                    logger.info("froze %s objects alive after startup out of the GC", frozen)
                url = _bound_url(self, settings)
                logger.info(
                    "momlp serving %s at %s (API docs at %s/docs)", settings.store, url, url
                )

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.started and not self.should_exit and drain.ask():
                return  # on_tick stops it when the window is over
            super().handle_exit(sig, frame)
            stop.event.set()  # a pool still starting stops waiting for its actors

        async def on_tick(self, counter: int) -> bool:
            if drain.due():
                self.should_exit = True
            return await super().on_tick(counter)

    server = _Server(uvicorn_config(app, settings))
    count_connections(app, server)
    # uvicorn takes both signals while it serves and re-raises them when done, so that the
    # default action runs; StopSignals' handlers, back in place then, absorb that, so a
    # requested stop exits 0. One that comes before uvicorn takes them still stops it.
    stop.on_stop(lambda: setattr(server, "should_exit", True))
    uvicorn_log = logging.getLogger("uvicorn.error")
    quiet_stop = _StopIsNotAnError(stop.event, server)
    uvicorn_log.addFilter(quiet_stop)
    try:
        with request_ids_in_access_log():
            server.run()
    except SystemExit as exc:
        # uvicorn exits this way when the lifespan fails or the port cannot be bound; it
        # has logged why. Ray still shuts down on the way out, and the caller gets 1.
        if server.started or exc.code != STARTUP_FAILURE:
            raise
    finally:
        uvicorn_log.removeFilter(quiet_stop)
    if not server.started:
        if stop.event.is_set():
            return _stopped_while_starting()
        logger.error("momlp did not start (see the errors above)")
        return 1
    logger.info("momlp stopped")
    return 0
