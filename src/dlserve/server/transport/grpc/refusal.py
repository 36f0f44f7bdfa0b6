"""A gRPC connection refused because the server holds ``--grpc-max-connections``.

gRPC clients retry a call on a new connection, on and on, when a server refuses it at
the HTTP/2 level (GOAWAY before any stream, or RST_STREAM REFUSED_STREAM): the caller
would wait and never hear why. So the refusal answers as a gRPC server does: the server's
SETTINGS, then, to the client's first call, a trailers-only response with status 14
UNAVAILABLE and a message that says why, then GOAWAY (last stream: that call, NO_ERROR)
and a half-close. The client's call fails at once with that status and message. Frames
are scanned only for their type and stream (no HPACK decoding); what the client sends is
bounded by ``_MAX_BUFFERED``, and the connection closes after ``refusal.LINGER_S``.
"""

from __future__ import annotations

from typing import Final

from dlserve.server.transport.refusal import Refusal

_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS: Final = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # empty: the server's preface
_SETTINGS_ACK: Final = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
_MESSAGE: Final = b"the server has too many connections (--grpc-max-connections)"
_MAX_BUFFERED: Final = 64 * 1024


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal field, not indexed, plain (names and values under 127 bytes)."""
    return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value


_TRAILERS: Final = b"".join((
    b"\x88",  # :status 200
    b"\x0f\x10" + bytes((16,)) + b"application/grpc",  # content-type (static name 31)
    _literal(b"grpc-status", b"14"),  # UNAVAILABLE
    _literal(b"grpc-message", _MESSAGE),
))  # fmt: skip


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    head = len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
    return head + payload


class GrpcRefusal(Refusal):
    """Answers the first call with UNAVAILABLE, then GOAWAY; drops the rest."""

    def __init__(self) -> None:
        super().__init__(_SETTINGS, half_close=False)
        self.buffer = bytearray()
        self.answered = False

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return
        self.buffer += data
        if len(self.buffer) > _MAX_BUFFERED:
            self.close()
            return
        self._scan()

    def _scan(self) -> None:
        buffer = self.buffer
        if buffer[:1] == b"P":  # the client's preface
            if len(buffer) < len(_PREFACE):
                return
            del buffer[: len(_PREFACE)]
        while len(buffer) >= 9:
            end = 9 + int.from_bytes(buffer[:3], "big")
            if len(buffer) < end:
                return
            kind, flags = buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            del buffer[:end]
            if kind == 0x4 and not flags & 0x1:  # SETTINGS, not an ACK
                self.write(_SETTINGS_ACK)
            elif kind == 0x1 and stream % 2:  # HEADERS: a call
                self._answer(stream)
                return

    def _answer(self, stream: int) -> None:
        self.answered = True
        goaway = stream.to_bytes(4, "big") + b"\x00\x00\x00\x00" + _MESSAGE  # NO_ERROR
        self.write(_frame(0x1, 0x5, stream, _TRAILERS) + _frame(0x7, 0, 0, goaway))
        self.half_close()
