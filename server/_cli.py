"""The `momlp` command: one argparse root, subcommands registered by each package.

Registration modules import only the standard library, so `momlp --help` is fast and
`momlp loadtest` works where torch and ray are not installed; each handler imports
what it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from experts_store import StoreError

__all__ = ["build_parser", "main"]

_REGISTRARS = (
    "experts_store._cli",
    "trainer._cli",
    "server._serve_cli",
    "client._cli",
)


def _refused_by_server(store: Any) -> str | None:
    """Why this server would not serve `store` (an open `experts_store.Store`), or None:
    opened as `momlp serve` opens it, for `momlp store verify`."""
    from experts_store import StoreError
    from router import RouterError
    from server._exceptions import ServerError
    from server.kinds import open_model

    try:
        open_model(store)
    except (ServerError, StoreError, RouterError) as exc:
        return str(exc)
    return None


def _calibrate_store(args: argparse.Namespace) -> int:
    """`momlp store calibrate`: the trainer fits τ (imported here, when the command runs)."""
    from trainer._cli import handle_store_calibrate

    return handle_store_calibrate(args)


# What a registrar's commands need from the layers above it, passed down to `register`.
_INJECTED: dict[str, dict[str, Any]] = {
    "experts_store._cli": {"serve_check": _refused_by_server, "calibrate": _calibrate_store},
}

Handler = Callable[[argparse.Namespace], int]


def _version() -> str:
    """The installed distribution's version ("unknown" when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("momlp")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="momlp",
        description="Build, serve and load-test a mixture of expert MLPs.",
    )
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=_LOG_LEVELS,
        help="logging level (before the command: momlp --log-level DEBUG serve ...)",
    )
    parser.add_argument("--version", action="version", version=f"momlp {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _REGISTRARS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            # A part not installed here (e.g. the client-only environment) offers no commands.
            continue
        module.register(subparsers, **_INJECTED.get(name, {}))
    return parser


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every request at INFO; a load test would print thousands of lines.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    if not getattr(args, "ray_address", None) and not os.environ.get("RAY_ADDRESS"):
        # An embedded Ray otherwise advertises the machine's outward address even though
        # every process is local; this keeps its traffic on loopback. Set before Ray is
        # imported, which only the handlers do.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        # Ray passes its processes' lines on (an actor's death is told by "(raylet)" lines)
        # wrapped in terminal colour codes, which are noise in a log file or a journal. Ray
        # reads this when it prints, so it holds for a Ray started later too.
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    address = getattr(args, "ray_address", None)
    if args.command == "build" and address and getattr(args, "executor", None) != "local":
        # ray.init waits ~14 minutes for a head that is not there, and a build reaches it
        # only after its prototype phase; `momlp serve` checks its address the same way.
        from server._serve_cli import ray_address_problem

        code, why = ray_address_problem(address)
        if code:
            print(f"momlp build: {why}", file=sys.stderr)
            return code
    # SIGTERM unwinds as Ctrl-C does, so that a build's staging folder and a calibration's
    # writer are removed (it killed the process where it stood, leaving them); `momlp
    # serve` takes the signal over for its own graceful stop.
    previous = _unwind_on_sigterm()
    try:
        code = handler(args)
        # Output to a pipe is buffered: a reader that went away shows here, not at exit.
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143  # 128 + SIGTERM, as a shell reports a process it ended
    except BrokenPipeError:
        # The reader went away (`momlp store info STORE | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a process killed by it
    except ModuleNotFoundError as exc:
        # Commands register without their heavy imports, so a client-only install lists
        # `momlp build` too; running it there should say what is missing, not crash.
        print(f"momlp {args.command}: needs the {exc.name!r} package, which is not installed"
              " (other server or build packages may be missing too: install momlp with its"
              " dependencies, `pip install momlp`)", file=sys.stderr)
        return 2
    except (StoreError, OSError) as exc:
        # A store's error (a build's publish into a full disk), or the machine's (a
        # read-only file system, permissions): one line, as every other failure of a command.
        print(f"momlp {args.command}: {exc}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM came: raised where the main thread was, so that `with` blocks clean up."""


def _raise_terminated(_sig: int, _frame: FrameType | None) -> None:
    raise Terminated


def _unwind_on_sigterm() -> Any:
    """Let SIGTERM raise `Terminated`; the handler it replaced (None off the main thread,
    where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


if __name__ == "__main__":
    sys.exit(main())
