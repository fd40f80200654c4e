"""One socket write per response: uvicorn's HTTP protocol over a transport that joins the
writes of one event-loop turn.

uvicorn writes a response's status line and headers when the app sends `http.response.start`
and its body when the app sends `http.response.body`: two writes, so two loopback segments,
two trips through the kernel's TCP stack in the server, and a client woken for the headers
and again for the body. An app sends both in one turn of the loop (predict answers with one
`Response`), so holding writes until the end of the turn sends the response in one write.
Nothing is reordered or dropped: writes go out in order, and a close first sends what is held.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["JoinedWrites", "joined_writes_protocol"]


class JoinedWrites:
    """An asyncio transport whose writes within one loop turn reach `transport` as one write.

    Everything but `write`, `writelines` and `close` goes to `transport` as is (flow control,
    `get_extra_info`, `is_closing`, `abort`: an abort drops what is held, as it drops what the
    transport has buffered).
    """

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is None:
            self._held = [bytes(data)]
            self._loop.call_soon(self.flush)
        else:
            self._held.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        """Send what is held now (the end of the loop turn does it otherwise)."""
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def joined_writes_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11) writing through
    `JoinedWrites`; pass it as `uvicorn.Config(http=...)`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class JoinedWritesProtocol(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            # Set after uvicorn's own setup: its flow control keeps the real transport, and
            # every response (and close) of the connection goes through the joined one.
            self.transport = JoinedWrites(transport, asyncio.get_running_loop())

    JoinedWritesProtocol.__name__ = f"JoinedWrites{base.__name__}"
    protocol: type[asyncio.Protocol] = JoinedWritesProtocol
    return protocol

