"""A direct channel for an actor's `run` calls: a Unix socket beside Ray's own call path.

A Ray actor call costs about 1 ms of CPU before any work on a 2-core machine (0.5 ms in the
caller, 0.5 ms in the actor: `benchmarks/actor_call.py`), and ~1.5 ms of latency, for every
batch on every actor. Ray still places, restarts and kills the actors, and carries their
`prefetch` and `info` calls; only `run`, the call on every batch, takes this shorter path when
the actor shares the server's node. Frames are `_wire`'s (no pickle).

Actor side: `ChannelServer` accepts connections on a socket file and answers each connection's
frames in order on a thread of its own (`run` is serialised in the actor anyway). Server side:
`Channel` is one connection; calls may overlap and are matched to answers by call number. When
the connection drops (the actor died), every pending call fails with `ChannelClosed`, and
`on_lost` hears of it at once, whether or not a call was pending: an idle pool learns of a dead
actor from its socket rather than from the next request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from server.pool._errors import ChannelCallFailed, ChannelClosed, WireError
from server.pool._types import ActorReply
from server.pool._wire import (
    PREFIX,
    RunDecoder,
    RunEncoder,
    RunPayload,
    decode_reply,
    encode_failure,
    encode_reply,
    parse_prefix,
)

__all__ = [
    "MAX_SOCKET_PATH",
    "Channel",
    "ChannelServer",
]

logger = logging.getLogger(__name__)

# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107


class ChannelServer:
    """Answers `run` frames on the Unix socket `path` until `close`."""

    def __init__(self, path: Path, run: Callable[[RunPayload], ActorReply]) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes")
        self.path = path
        self._run = run
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.unlink(missing_ok=True)
        self._listener.bind(os.fspath(path))
        self._listener.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, name="momlp-channel", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (Linux)
        except OSError:
            pass
        self._listener.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(conn,), name="momlp-channel-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        decoder = RunDecoder()  # the refs this connection defined
        with conn, conn.makefile("rb") as stream:
            while True:
                try:
                    frame = _read_frame(stream)
                except (OSError, WireError) as exc:
                    logger.warning("closing a channel connection: %s", exc)
                    return
                if frame is None:
                    return
                try:
                    call, payload = decoder.decode(*frame)
                except WireError as exc:
                    logger.warning("closing a channel connection on a bad frame: %s", exc)
                    return
                try:
                    answer = encode_reply(call, self._run(payload))
                except Exception as exc:  # the caller gets the reason, the actor lives on
                    logger.exception("run failed on the channel")
                    answer = encode_failure(call, f"{type(exc).__name__}: {exc}")
                try:
                    conn.sendall(answer)
                except OSError:
                    return


def _read_frame(stream: BinaryIO) -> tuple[bytes, bytes] | None:
    """(header, body) of the next frame; None at a clean end of stream."""
    prefix = stream.read(PREFIX.size)
    if not prefix:
        return None
    if len(prefix) < PREFIX.size:
        raise WireError("stream ended inside a frame's prefix")
    header_len, body_len = parse_prefix(prefix)
    header = stream.read(header_len)
    body = stream.read(body_len)
    if len(header) < header_len or len(body) < body_len:
        raise WireError("stream ended inside a frame")
    return header, body


class Channel:
    """The server's end of one connection to a `ChannelServer` (one event loop)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_lost: Callable[[Channel, str], None] | None = None,
    ) -> None:
        self._reader = reader
        self._on_lost = on_lost
        self._writer = writer
        self._pending: dict[int, asyncio.Future[ActorReply]] = {}
        self._calls = itertools.count()
        self._write_lock = asyncio.Lock()
        self._encoder = RunEncoder()
        self._closed: str | None = None
        self._receiver = asyncio.get_running_loop().create_task(self._receive())

    @classmethod
    async def connect(
        cls, path: Path, on_lost: Callable[[Channel, str], None] | None = None
    ) -> Channel:
        """Connect to the socket at `path`; `OSError` if nothing answers there. `on_lost(self,
        reason)` is called once if the actor's end drops the connection (not after `close`)."""
        reader, writer = await asyncio.open_unix_connection(os.fspath(path), limit=1 << 20)
        return cls(reader, writer, on_lost)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def forget_refs(self) -> None:
        """Both ends drop the refs defined so far, at the next call (`RunEncoder.forget`)."""
        self._encoder.forget()

    async def run(self, payload: RunPayload) -> ActorReply:
        """The actor's `run(payload)`; `ChannelClosed` if the connection drops before the
        answer, `ChannelCallFailed` if `run` raised."""
        if self._closed is not None:
            raise ChannelClosed(self._closed)
        call = next(self._calls)
        answer: asyncio.Future[ActorReply] = asyncio.get_running_loop().create_future()
        self._pending[call] = answer
        # One `finally` from here: a caller cancelled while it waits for the write lock or in
        # drain() left its entry (and, once answered, the reply's arrays) for good.
        try:
            try:
                async with self._write_lock:
                    # Encoded and written with no await between: a frame that defines a ref
                    # reaches the actor before any frame that uses it.
                    frame = self._encoder.encode(call, payload)
                    self._writer.write(frame)
                    await self._writer.drain()
            except OSError as exc:
                self._close(f"write failed: {exc}")
            return await answer
        finally:
            # A cancelled caller's answer, if it ever comes, is dropped on arrival.
            self._pending.pop(call, None)

    async def close(self) -> None:
        self._close("closed by the server")
        self._receiver.cancel()
        await asyncio.gather(self._receiver, return_exceptions=True)

    async def _receive(self) -> None:
        try:
            while True:
                header_len, body_len = parse_prefix(await self._reader.readexactly(PREFIX.size))
                header = await self._reader.readexactly(header_len)
                body = await self._reader.readexactly(body_len)
                call, reply = decode_reply(header, body)
                answer = self._pending.get(call)
                if answer is None or answer.done():
                    continue
                if isinstance(reply, str):
                    answer.set_exception(ChannelCallFailed(reply))
                else:
                    answer.set_result(reply)
        except asyncio.IncompleteReadError:
            self._lost("the actor closed the connection")
        except (OSError, WireError) as exc:
            self._lost(f"{type(exc).__name__}: {exc}")

    def _lost(self, reason: str) -> None:
        if self._close(reason) and self._on_lost is not None:
            self._on_lost(self, reason)

    def _close(self, reason: str) -> bool:
        """Fail the pending calls; True if this closed the channel (it was open)."""
        first = self._closed is None
        if first:
            self._closed = reason
            self._writer.close()
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(ChannelClosed(reason))
        self._pending.clear()
        return first
