"""A raw HTTP/2 client for protocol tests against a running server: a socket, frames built
by hand (right or deliberately wrong), and what the server answers, read frame by frame.

``Raw.outcome()`` reads until the server shows what it made of the frames sent: a
GOAWAY (a connection error: ``("goaway", code)``), an RST_STREAM (a stream error:
``("rst", code)``), the end of a response (``("response", grpc-status)``) or the ACK of
the PING that ``probe`` sent after them (``("ok",)``: nothing went wrong)."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.frames import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    frame,
)

LIVE = b"/inference.GRPCInferenceService/ServerLive"
EMPTY_MESSAGE = bytes(5)  # a gRPC message of no bytes: ServerLiveRequest
PROBE = b"probe\x00\x00\x00"
DEADLINE_S = 10.0
Outcome = tuple[Any, ...]


def request(
    path: bytes = LIVE, extra: tuple[tuple[bytes, bytes], ...] = (),
    omit: tuple[bytes, ...] = (),
) -> bytes:  # fmt: skip
    """A gRPC request's header block (literals), ``extra`` fields after, ``omit`` left out."""
    fields = [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
        (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]  # fmt: skip
    return hpack_codec.encode([(n, v) for n, v in fields if n not in omit] + list(extra))


class Raw:
    """One connection to the server's gRPC port."""

    def __init__(self, port: int, handshake: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), DEADLINE_S)
        self.sock.settimeout(DEADLINE_S)
        self._buffer = b""
        self.settings: dict[int, int] = {}
        if handshake:
            self.send(PREFACE + frame(SETTINGS, 0, 0))
            kind, flags, _, payload = self.frame()
            assert (kind, flags) == (SETTINGS, 0)
            for at in range(0, len(payload), 6):
                key = int.from_bytes(payload[at : at + 2], "big")
                self.settings[key] = int.from_bytes(payload[at + 2 : at + 6], "big")
            self.send(frame(SETTINGS, ACK, 0))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        """Send, as an attacker does: on, whether the server still reads or not."""
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            self.sock.sendall(data)

    def headers(self, stream: int, block: bytes, end_stream: bool = False, flags: int = 0) -> None:
        flags |= END_HEADERS | (END_STREAM if end_stream else 0)
        self.send(frame(HEADERS, flags, stream, block))

    def call(self, stream: int) -> None:
        """A whole ServerLive call on ``stream``."""
        self.headers(stream, request())
        self.send(frame(DATA, END_STREAM, stream, EMPTY_MESSAGE))

    def frame(self) -> tuple[int, int, int, bytes]:
        """The server's next frame; EOFError when it has closed the connection."""
        while len(self._buffer) < 9 or len(self._buffer) < 9 + int.from_bytes(
            self._buffer[:3], "big"
        ):
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("the server closed the connection")
            self._buffer += chunk
        size = int.from_bytes(self._buffer[:3], "big")
        head, payload = self._buffer[:9], self._buffer[9 : 9 + size]
        self._buffer = self._buffer[9 + size :]
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload

    def probe(self) -> None:
        self.send(frame(PING, 0, 0, PROBE))

    def outcome(self) -> Outcome:
        decoder = hpack_codec.Decoder()
        while True:
            try:
                kind, flags, _, payload = self.frame()
            except (EOFError, ConnectionResetError):
                return ("closed",)
            if kind == GOAWAY:
                return ("goaway", int.from_bytes(payload[4:8], "big"), payload[8:])
            if kind == RST_STREAM:
                return ("rst", int.from_bytes(payload, "big"))
            if kind == PING and flags & ACK and payload == PROBE:
                return ("ok",)
            if kind == HEADERS:
                fields = dict(decoder.decode(payload))
                if flags & END_STREAM:
                    return ("response", int(fields["grpc-status"]))

    def goaway(self) -> int:
        """The code of the GOAWAY the server sends next (after any other frames)."""
        while True:
            kind, _, _, payload = self.frame()
            if kind == GOAWAY:
                return int.from_bytes(payload[4:8], "big")
