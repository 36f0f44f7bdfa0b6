"""A gRPC client that writes HTTP/2 frames itself, for what no real client sends: bytes
after a message, a length prefix that lies, a compressed flag without an encoding, a
pre-compressed bomb, a window of 0 that never grows, a socket never read.

:class:`RawGrpc` is one connection (a blocking socket); ``call`` opens a stream and sends
its messages, ``status`` reads until that stream's trailers and returns its gRPC status
(code, percent-decoded message)."""

from __future__ import annotations

import socket
import time
from urllib.parse import unquote

from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)

INFER = b"/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = b"/inference.GRPCInferenceService/ModelStreamInfer"


def message(payload: bytes, flag: int = 0) -> bytes:
    """A gRPC Length-Prefixed-Message: its flag, its length, its bytes."""
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


class RawGrpc:
    """One HTTP/2 connection to a gRPC server, frames written by hand. ``window``: the
    initial stream window the client gives the server (0: it may send no response)."""

    def __init__(self, url: str, window: int = MAX_WINDOW) -> None:
        host, port = url.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        settings = b"\x00\x04" + window.to_bytes(4, "big")
        self.sock.sendall(
            PREFACE + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65535).to_bytes(4, "big"))
        )  # fmt: skip
        self._decoder = hpack_codec.Decoder()
        self._buffer = b""
        self.next_stream = 1

    def close(self) -> None:
        self.sock.close()

    def call(
        self, path: bytes, body: bytes, *extra: tuple[bytes, bytes], end: bool = True
    ) -> int:  # fmt: skip
        """Open a stream, send ``body`` (messages, or whatever a test wants) and, with
        ``end``, the end of the client's side; the stream's id."""
        stream = self.next_stream
        self.next_stream += 2
        block = hpack_codec.encode([
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
            (b":authority", b"x"), (b"content-type", b"application/grpc"),
            (b"te", b"trailers"), *extra,
        ])  # fmt: skip
        out = [frame(HEADERS, END_HEADERS, stream, block)]
        for at in range(0, len(body), 16384):  # the server's initial SETTINGS_MAX_FRAME_SIZE
            out.append(frame(DATA, 0, stream, body[at : at + 16384]))
        if end:
            out.append(frame(DATA, END_STREAM, stream))
        self.sock.sendall(b"".join(out))
        return stream

    def status(self, stream: int, deadline_s: float = 30) -> tuple[int, str]:
        """Read until the stream's trailers; its gRPC status."""
        deadline = time.monotonic() + deadline_s
        while True:
            kind, flags, sid, payload = self._frame(deadline)
            if kind == HEADERS:
                fields = dict(self._decoder.decode(payload))
                if sid == stream and flags & END_STREAM:
                    return int(fields["grpc-status"]), unquote(fields.get("grpc-message", ""))
            elif kind == GOAWAY and not sid:
                raise ConnectionError(f"GOAWAY: {payload[8:]!r}")
            elif kind == DATA and payload:  # keep the server's window open
                size = len(payload).to_bytes(4, "big")
                updates = frame(WINDOW_UPDATE, 0, 0, size) + frame(WINDOW_UPDATE, 0, sid, size)
                self.sock.sendall(updates)

    def first_data(self, stream: int, deadline_s: float = 30) -> bytes:
        """Read until the stream's first DATA frame; its payload (a message, when small)."""
        deadline = time.monotonic() + deadline_s
        while True:
            kind, _, sid, payload = self._frame(deadline)
            if kind == DATA and sid == stream and payload:
                return payload
            if kind == GOAWAY and not sid:
                raise ConnectionError(f"GOAWAY: {payload[8:]!r}")

    def closed_by_server(self, deadline_s: float) -> bool:
        """Whether the server closes the connection within ``deadline_s`` (what it sends
        meanwhile is read and dropped)."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
            if not chunk:
                return True
        return False

    def _frame(self, deadline: float) -> tuple[int, int, int, bytes]:
        while True:
            if len(self._buffer) >= 9:
                size = int.from_bytes(self._buffer[:3], "big")
                if len(self._buffer) >= 9 + size:
                    head, self._buffer = self._buffer[: 9 + size], self._buffer[9 + size :]
                    sid = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                    return head[3], head[4], sid, head[9:]
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self._buffer += chunk
