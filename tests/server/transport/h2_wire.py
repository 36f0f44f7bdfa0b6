"""An HTTP/2 client's side of a connection without a socket: the frames a test feeds a
connection, and :class:`Wire`, the connection's output, which records what it writes as
frames (each ``write``/``writelines`` call kept as one batch)."""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import pytest

from dlserve.server.transport.h2 import hpack_codec, limits
from dlserve.server.transport.h2.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    MAX_WINDOW,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)


def still_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flood budgets' clock stands still for the test: one that counts frames against a
    budget gets the same count however slowly the machine runs it (no token comes back)."""
    monkeypatch.setattr(limits, "time", types.SimpleNamespace(monotonic=lambda: 0.0))


class Frame(NamedTuple):
    kind: int
    flags: int
    stream: int
    payload: bytes


class Wire:
    """What a connection writes, parsed into frames; ``closed`` once it closes."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.batches: list[list[Frame]] = []  # the frames of each write call
        self.closed = False
        self.paused = False
        self._buffer = bytearray()

    # -- the connection's output (what asyncio's transport does for it) --------------------
    def write(self, data: bytes) -> None:
        self._take([data])

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        self._take(parts)

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket, no peer

    def _take(self, parts: list[bytes | memoryview]) -> None:
        assert not self.closed, "written after close"
        for part in parts:
            self._buffer += part
        batch = []
        while len(self._buffer) >= 9:
            size = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + size:
                break
            head, payload = self._buffer[:9], bytes(self._buffer[9 : 9 + size])
            stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            batch.append(Frame(head[3], head[4], stream, payload))
            del self._buffer[: 9 + size]
        self.frames += batch
        self.batches.append(batch)

    # -- reading it ------------------------------------------------------------------------
    def take(self) -> list[Frame]:
        """The frames written since the last ``take``."""
        frames, self.frames = self.frames, []
        return frames

    def of(self, stream: int, kind: int | None = None) -> list[Frame]:
        return [f for f in self.frames if f.stream == stream and kind in (None, f.kind)]


def opening(window: int = MAX_WINDOW) -> bytes:
    """A client's preface and SETTINGS, with this initial stream window, and as much
    connection window as HTTP/2 allows."""
    settings = b"\x00\x04" + window.to_bytes(4, "big")
    return (
        PREFACE + frame(SETTINGS, 0, 0, settings)
        + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65535).to_bytes(4, "big"))
    )  # fmt: skip


def request_head(
    path: bytes = b"/t.S/Echo", *extra: tuple[bytes, bytes], method: bytes = b"POST",
    content_type: bytes = b"application/grpc",
) -> bytes:  # fmt: skip
    """A gRPC request's header block, as a client sends it (literals, no table)."""
    return hpack_codec.encode([
        (b":method", method), (b":scheme", b"http"), (b":path", path),
        (b":authority", b"x"), (b"content-type", content_type), *extra,
    ])  # fmt: skip


def headers(stream: int, block: bytes, end_stream: bool = False) -> bytes:
    return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream, block)


def data(stream: int, payload: bytes, end_stream: bool = False) -> bytes:
    return frame(DATA, END_STREAM if end_stream else 0, stream, payload)


def message(payload: bytes, compressed: bool = False) -> bytes:
    """A gRPC message: its flag, its length, its bytes."""
    return bytes([compressed]) + len(payload).to_bytes(4, "big") + payload


def fields(block: bytes) -> dict[str, str]:
    return dict(hpack_codec.Decoder().decode(block))
