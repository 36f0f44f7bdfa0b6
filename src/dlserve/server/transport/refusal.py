"""A connection refused because its listener holds its maximum of connections.

The refusal is one message in the listener's protocol (HTTP/1.1: a ``503`` with
``Connection: close``; gRPC: ``grpc/refusal.py``), written as the connection opens (or
once the client has asked). The server then half-closes and discards what the client
still sends until the client closes too, or for ``LINGER_S``: closing at once, with the
client's request unread in the socket, would make the kernel answer with a reset that may
reach the client before the refusal does. At most ``MAX_LINGERING`` refused connections
linger; past that a refused connection is closed right after its refusal is written.
"""

from __future__ import annotations

import asyncio
from typing import Final, cast

LINGER_S: Final = 1.0
MAX_LINGERING: Final = 256


class Refusal(asyncio.Protocol):
    """Writes ``message``, half-closes (unless told), drops what arrives until EOF or
    ``LINGER_S``."""

    lingering = 0  # refused connections open now, over every listener

    def __init__(self, message: bytes, half_close: bool = True) -> None:
        self.message = message
        self.half_close_at_once = half_close
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.write(self.message)
        if Refusal.lingering >= MAX_LINGERING:
            transport.close()
            return
        Refusal.lingering += 1
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        if self.half_close_at_once:
            self.half_close()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def half_close(self) -> None:
        """No more from the server (a TLS connection, which cannot half-close, closes)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: it is refused

    def eof_received(self) -> bool | None:
        return None  # the client is done too: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            Refusal.lingering -= 1
