"""`momlp serve` and `momlp demo`; only the standard library is imported until a handler runs."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["parse_bytes", "ray_address_problem", "register", "settings_from_args"]

logger = logging.getLogger(__name__)

DEMO_STORE = Path("demo-store")
# How long a --ray-address head may take to accept a TCP connection before serve gives up.
_CONNECT_TIMEOUT_S = 10.0
# Between two tries of a head that did not answer.
_RETRY_S = 0.5


def parse_bytes(text: str) -> int:
    """`268435456`, `256MiB`, `1.5GB` -> bytes (the settings' own parser, for argparse)."""
    from server._settings import byte_size

    try:
        return byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _store_path(text: str) -> Path:
    # Path("") is Path("."): a blank --store (a template's unset variable) served the
    # working directory.
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is blank (give . for this directory)")
    return Path(text)


def _add_server_options(parser: argparse.ArgumentParser, *, store_help: str) -> None:
    # Defaults are None so that an option not given leaves the MOMLP_* environment (or the
    # Settings default) in charge.
    parser.add_argument("--store", type=_store_path, help=store_help)
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default 8000; 0 picks one)")
    parser.add_argument("--actors", type=int, help="expert actors on CPU (one per GPU on CUDA)")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help="default auto: CUDA when the Ray cluster has a GPU, else CPU",
    )
    parser.add_argument(
        "--cache-bytes",
        type=parse_bytes,
        help="expert cache budget per actor, bytes (e.g. 512MiB, 2GB; default 256MiB)",
    )
    parser.add_argument(
        "--host-cache-bytes",
        type=parse_bytes,
        help="CUDA actors: pinned host memory, bytes, each keeps loaded experts' files in"
        " (e.g. 4GiB; default 0: off)",
    )
    parser.add_argument(
        "--cache-policy",
        choices=["tinylfu", "lru"],
        help="which experts stay cached (default tinylfu: popular ones; lru: recent ones)",
    )
    parser.add_argument("--ray-address", help="Ray cluster to join (default: embedded Ray)")
    parser.add_argument(
        "--ray-connect-wait-s",
        type=float,
        metavar="S",
        help="wait up to S seconds for a --ray-address HOST:PORT head to accept a connection"
        " (default 30; 0: give up at once)",
    )
    parser.add_argument("--ray-num-cpus", type=int, help="CPUs of an embedded Ray")
    parser.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the bearer key (MOMLP_API_KEY is read anyway)",
    )
    parser.add_argument(
        "--max-batch-wait-ms", type=float, metavar="MS", help="batch window, ms (default 2)"
    )
    parser.add_argument("--max-rows", type=int, help="rows per request (default 8192; 413 above)")
    parser.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        help="request body limit, bytes (e.g. 64MiB; default 32MiB; 413 above)",
    )
    parser.add_argument(
        "--watch-store",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reload when the store's manifest.json changes (default on)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        metavar="S",
        help="after SIGTERM/SIGINT, serve on for S seconds with /readyz 503 (default 0)",
    )
    parser.add_argument(
        "--watch-interval-s",
        type=float,
        metavar="S",
        help="how often the watcher looks at manifest.json (default 2)",
    )


_FIELDS = (
    "store",
    "host",
    "port",
    "actors",
    "device",
    "cache_bytes",
    "host_cache_bytes",
    "cache_policy",
    "ray_address",
    "ray_connect_wait_s",
    "ray_num_cpus",
    "max_batch_wait_ms",
    "max_rows",
    "max_body_bytes",
    "watch_store",
    "watch_interval_s",
    "drain_s",
)


class CliError(Exception):
    """A problem with the command line or environment, reported without a traceback."""


def settings_from_args(args: argparse.Namespace) -> Any:
    """The `server.Settings` for these options (environment variables fill the rest)."""
    from pydantic import ValidationError

    from server._settings import Settings

    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None
    }
    env_name = getattr(args, "api_key_env", None)
    if env_name:
        key = os.environ.get(env_name)
        if not key:
            raise CliError(f"--api-key-env {env_name}: that environment variable is empty or unset")
        overrides["api_key"] = key
    for warning in misspelt_settings(os.environ, Settings.model_fields):
        logger.warning("%s", warning)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            # A check across settings names them itself (its loc is empty).
            f"{_setting_name(err['loc'], set(overrides))}: "
            f"{str(err['msg']).removeprefix('Value error, ')}" if err["loc"]
            else str(err["msg"]).removeprefix("Value error, ")
            for err in exc.errors()
        )
        raise CliError(f"invalid settings: {problems}") from exc


def _setting_name(loc: tuple[int | str, ...], given: set[str]) -> str:
    """How the user set the field a validation error names: its option or its variable."""
    field = ".".join(str(part) for part in loc)
    if field in given and field != "api_key":
        return "--" + field.replace("_", "-")
    return "MOMLP_" + field.upper()


def misspelt_settings(environ: Mapping[str, str], fields: Iterable[str]) -> list[str]:
    """A warning for each MOMLP_ variable that names no setting but nearly names one: the
    settings read only the names they know, so MOMLP_ACTOR=3 was silently no setting at all.
    (Other MOMLP_ names, the deploy scripts' and benchmarks' own, are not settings' typos.)"""
    known = {"MOMLP_" + field.upper() for field in fields}
    warnings = []
    for name in sorted(environ):
        if not name.startswith("MOMLP_") or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            warnings.append(f"{name} is not a momlp setting and is ignored; did you mean"
                            f" {close[0]}?")
    return warnings


def _settings_or_none(args: argparse.Namespace) -> Any:
    try:
        return settings_from_args(args)
    except CliError as exc:
        logger.error("%s", exc)
        return None


def _has_manifest(store: Path) -> bool:
    try:
        return (store / "manifest.json").is_file()
    except OSError:
        # Unreadable (permissions): there is something; opening the store says what is wrong
        # in one line, where is_file's own error was a traceback.
        return True


def ray_address_problem(
    address: str,
    timeout_s: float = _CONNECT_TIMEOUT_S,
    *,
    wait_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[int, str]:
    """(exit code, why) when `address` is no Ray cluster this process can join; (0, "") else.

    ray.init itself waits for an unreachable head for ~14 minutes, printing only its own
    retries, and answers a malformed address with a traceback. A HOST:PORT nobody answers at
    is tried again until `wait_s` seconds have passed (a head that starts after the server,
    as under a supervisor or in a pod; one try may take `timeout_s` more); a malformed one is
    refused at once. `clock`, `sleep`: the time the wait is measured and spent in.
    """
    if address in ("auto", "local") or address.startswith("ray://"):
        return 0, ""  # Ray's own forms: Ray resolves and checks them
    host, _, port = address.rpartition(":")
    if not host or "/" in host or not port.isdecimal() or not 0 < int(port) < 65536:
        return 2, f"--ray-address {address!r} is not HOST:PORT (e.g. 127.0.0.1:6379), auto or ray://"
    deadline = clock() + wait_s
    waiting = False
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                if waiting:
                    logger.info("the Ray head at %s answers", address)
                return 0, ""
        except OSError as exc:
            # Every OSError: refused (the head is not listening yet), unreachable or a name that
            # does not resolve yet (a Kubernetes service before its pod is ready).
            problem = exc.strerror or str(exc)
        left = deadline - clock()
        if left <= 0:
            return 1, (
                f"no Ray cluster answers at {address} ({problem})"
                + (f" after {wait_s:g} s" if wait_s > 0 else "")
                + "; start it first (deploy/local-cluster.sh start, or `ray start --head`)"
            )
        if not waiting:
            logger.warning(
                "no Ray cluster answers at %s yet (%s); waiting up to %g s for it to start",
                address, problem, wait_s,
            )
            waiting = True
        sleep(min(_RETRY_S, left))


def _ray_head_problem(settings: Any) -> int:
    """The exit code (logged why) when `settings.ray_address` is no Ray head to join, after
    waiting up to `ray_connect_wait_s` for one that starts late; 0 when it is (or none)."""
    if not settings.ray_address:
        return 0
    code, why = ray_address_problem(settings.ray_address, wait_s=settings.ray_connect_wait_s)
    if code:
        logger.error("%s", why)
    return code


def _run(settings: Any) -> int:
    from server._runner import run_server

    code = _ray_head_problem(settings)
    if code:
        return code

    try:
        socket.getaddrinfo(settings.host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        # Found now: with --port 0 the bind check is skipped and uvicorn found it only after
        # Ray, the actors and the store were up, in a line that named neither the host nor
        # the option.
        logger.error(
            "--host / MOMLP_HOST %r is no address of this machine's resolver (%s)",
            settings.host, exc.strerror or exc,
        )
        return 2

    store = Path(settings.store)
    if store.is_file():
        logger.error(
            "--store %s is a file; it takes the store's directory%s", store,
            f" (its parent, {store.parent}?)" if _has_manifest(store.parent) else "",
        )
        return 2
    if not _has_manifest(store):
        logger.error(
            "no store at %s (manifest.json missing): build one with `momlp build` or run "
            "`momlp demo`",
            settings.store,
        )
        return 2
    return run_server(settings)


def _serve(args: argparse.Namespace) -> int:
    settings = _settings_or_none(args)
    return 2 if settings is None else _run(settings)


def _demo(args: argparse.Namespace) -> int:
    from server.pool import ray_session

    if args.store is None and "MOMLP_STORE" not in os.environ:
        args.store = DEMO_STORE
    settings = _settings_or_none(args)
    if settings is None:
        return 2
    store = Path(settings.store)
    if not args.rebuild and _has_manifest(store):
        logger.info("using the demo store already in %s", store)
        return _run(settings)
    from trainer import build_store, quick_demo_config

    # The head is checked (and waited for) before Ray, as serve's is: ray.init waits ~14
    # minutes for a head that is not there and answers a malformed address with a traceback.
    code = _ray_head_problem(settings)
    if code:
        return code
    # One Ray for the build and the server: starting a second one costs tens of seconds here.
    with ray_session(address=settings.ray_address, num_cpus=settings.ray_num_cpus):
        logger.info("building the demo store (2-D Ackley, 16 experts) into %s", store)
        with _sigterm_as_interrupt():
            build_store(quick_demo_config(store))
        return _run(settings)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the build as Ctrl-C does (the build's staging is removed, Ray is shut
    down, exit 130). ray.init put Ray's own handler in, which aborted with a crash dump; the
    server puts its own in when it starts."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def register(subparsers: Any) -> None:
    """Add `serve` and `demo` to the `momlp` root parser."""
    serve = subparsers.add_parser(
        "serve",
        help="serve a store over HTTP",
        description="Serve a momlp store: POST /v1/predict, /v1/route; docs at /docs.",
    )
    _add_server_options(serve, store_help="store directory (default ./store)")
    serve.set_defaults(handler=_serve)

    demo = subparsers.add_parser(
        "demo",
        help="build the demo store if absent, then serve it",
        description="Build the 2-D Ackley demo store (16 experts) into ./demo-store if it is "
        "not there yet, then serve it like `momlp serve`.",
    )
    _add_server_options(demo, store_help=f"demo store directory (default ./{DEMO_STORE})")
    demo.add_argument("--rebuild", action="store_true", help="rebuild even if the store exists")
    demo.set_defaults(handler=_demo)
