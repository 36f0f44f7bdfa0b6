"""HTTP/2 frames as ``connection.py`` reads them and ``sending.py`` writes them: the frame
types, flags and error codes they use (RFC 9113), their limits and settings, and one
stream's state."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Final

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED = 0x0, 0x1, 0x3, 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB

MAX_WINDOW: Final = 2**31 - 1
MIN_FRAME: Final = 2**14  # SETTINGS_MAX_FRAME_SIZE's initial value and least allowed
MAX_FRAME: Final = 2**24 - 1  # and its largest
HIGH_WATER: Final = 4 * 2**20  # queued bytes of a stream past which its producer waits
STREAM_WINDOW: Final = 16 * 2**20  # what a client may send on a stream before we take it
CONNECTION_WINDOW: Final = 64 * 2**20  # and on all its streams together


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (len(payload) << 48 | kind << 40 | flags << 32 | stream_id).to_bytes(9, "big") + payload


def bytes_view(piece: memoryview | bytes) -> memoryview | bytes:
    """A piece of a message as bytes: a typed or shaped view (a tensor's) is recast."""
    if isinstance(piece, memoryview) and (piece.ndim != 1 or piece.format != "B"):
        return piece.cast("B")
    return piece


class ProtocolError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class StreamState:
    """One stream's flow-control and outgoing state, as the connection keeps it."""

    __slots__ = ("drain_waiter", "ended", "expected", "out", "queued", "recv_pending",
                 "remote_ended", "send_window", "stream_id")  # fmt: skip

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.stream_id = stream_id
        self.send_window = send_window
        self.recv_pending = 0  # bytes received since the stream's window was last given back
        self.ended = False  # we have sent END_STREAM (or reset it): nothing more goes out
        self.remote_ended = False  # the client has sent END_STREAM: half-closed (remote)
        self.expected = -1  # DATA bytes still due by the request's content-length, if any
        # what waits for the client's window: data pieces, or a frame that needs none
        self.out: deque[memoryview | bytes | tuple[bytes]] = deque()
        self.queued = 0  # data bytes in ``out``
        self.drain_waiter: asyncio.Future[None] | None = None  # a producer waiting on it

    def wake(self) -> None:
        waiter, self.drain_waiter = self.drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
