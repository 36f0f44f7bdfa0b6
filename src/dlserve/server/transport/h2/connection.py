"""The HTTP/2 that gRPC needs, server side (RFC 9113): one connection's state machine.

It is driven by three calls and nothing else: ``connection_made(output)``,
``data_received(bytes)`` (any cut of the client's bytes) and ``connection_lost()``; what it
sends goes to ``output`` (``write``, ``writelines``, ``close``: ``sending.Output``). asyncio
makes these calls with a socket's transport, as for any ``asyncio.Protocol``; a test makes
them with bytes and a recorder, no socket. Frames are parsed straight out of the bytes
given and a request's response leaves in one ``writelines``: no thread, no queue between.

What it does: the connection preface and SETTINGS (both ways), PING answered at once,
HEADERS with CONTINUATION, padding and priority (header blocks: ``hpack_codec.py``),
DATA, flow control both ways, RST_STREAM, GOAWAY both ways. Receiving: the connection's
window is as large as HTTP/2 allows, a stream's is 16 MiB, given back as its messages
are taken (a subclass may hold it back: :meth:`Connection.holding`). Sending is the
``Sender``'s (``sending.py``), which the connection owns: DATA waits for the client's
windows, and a producer may wait while a stream has more than ``HIGH_WATER`` bytes queued
(``drained``). Not: server push, priority scheduling, h2c upgrade; TLS is the output's.

``Connection`` knows nothing of gRPC: the subclass in ``grpc/rpc.py`` gets
:meth:`Connection.stream_opened`, :meth:`~Connection.stream_data`,
:meth:`~Connection.stream_reset` and :meth:`~Connection.closed` calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final, cast

from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_FRAME,
    MAX_HEADER_BLOCK,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_WINDOW,
    WINDOW_UPDATE,
    ProtocolError,
    StreamState,
    frame,
)
from dlserve.server.transport.h2.hpack_codec import Headers
from dlserve.server.transport.h2.sending import Output, Sender

log = logging.getLogger("dlserve.grpc")

_STREAM_FRAME: Final = 256 * 1024  # DATA frames this large are handed on as they arrive
_REPLENISH: Final = 2**30  # give the connection's window back once this much has come
_STREAM_REPLENISH: Final = STREAM_WINDOW // 2
_SETTING_INITIAL_WINDOW, _SETTING_MAX_FRAME = 0x4, 0x5
_OUR_SETTINGS: Final = (
    _SETTING_INITIAL_WINDOW.to_bytes(2, "big") + STREAM_WINDOW.to_bytes(4, "big")
    + _SETTING_MAX_FRAME.to_bytes(2, "big") + MAX_FRAME.to_bytes(4, "big")
)  # fmt: skip


class Connection(asyncio.Protocol):
    """One HTTP/2 connection. Subclasses answer the ``stream_*`` calls."""

    def __init__(self) -> None:
        self.transport: Output | None = None
        self.streams: dict[int, StreamState] = {}
        self.sender = Sender(self.streams)
        # the sender's calls, held once: a call's per-message loop and the frame loop
        # call them with no attribute chain in between
        self.send = self.sender.send
        self.drained = self.sender.drained
        self.stop_reading = self.sender.stop_reading
        self._write = self.sender.write
        self._flush = self.sender.flush
        self._flush_blocked = self.sender.flush_blocked
        self.last_stream_id = 0
        self.going_away = False
        self._partial: list[bytes] = []  # the start of a frame still arriving
        self._partial_size = 0
        self._needed = 0  # bytes the partial frame needs in all
        # a large DATA frame whose payload is handed on as it arrives, not joined first:
        # (stream id, its flags, payload bytes still to come)
        self._streaming: tuple[int, int, int] | None = None
        self._preface = False
        self._decoder = hpack_codec.Decoder()
        self._peer_window = 65535  # the client's initial stream window for what we send
        self._recv_pending = 0
        self._continuing: StreamState | None = None
        self._flags = 0  # of the HEADERS frame that began the block being continued

    # -- for subclasses -------------------------------------------------------------------
    def stream_opened(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        raise NotImplementedError

    def stream_data(self, stream_id: int, data: memoryview | bytes, end_stream: bool) -> None:
        raise NotImplementedError

    def stream_reset(self, stream_id: int) -> None:
        raise NotImplementedError

    def closed(self) -> None:
        """The connection is gone; every stream with it."""

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = self.sender.output = cast(asyncio.Transport, transport)
        self.transport.write(
            frame(SETTINGS, 0, 0, _OUR_SETTINGS)
            + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65535).to_bytes(4, "big"))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for stream in self.streams.values():
            stream.wake()
        self.streams.clear()
        self.sender.close()
        self.closed()

    def data_received(self, data: bytes) -> None:
        """Frames are parsed straight out of ``data``; a frame that arrives in pieces is
        joined once, when its last piece is in (one copy, whatever its size), except a large
        DATA frame, whose payload is handed on piece by piece as it arrives (no copy here)."""
        pos = 0
        if self._streaming is not None:
            pos = self._stream_piece(data)
            if pos == len(data):
                return
        elif self._partial:
            self._partial.append(data)
            self._partial_size += len(data)
            if self._partial_size < self._needed:
                return
            data = b"".join(self._partial)
            self._partial.clear()
        if not self._preface:
            if len(data) < len(PREFACE) and PREFACE.startswith(data):
                self._keep(data, len(PREFACE))
                return
            if not data.startswith(PREFACE):
                self.abort()
                return
            self._preface = True
            pos = len(PREFACE)
        try:
            pos = self._read_frames(data, pos)
        except ProtocolError as exc:
            log.debug("HTTP/2 protocol error: %s", exc)
            self._go_away(exc.code, str(exc))
            return
        if pos < len(data) and self.transport is not None:
            rest = data[pos:]
            self._keep(rest, 9 + (int.from_bytes(rest[:3], "big") if len(rest) >= 9 else 0))

    def _keep(self, rest: bytes, needed: int) -> None:
        self._partial = [rest]
        self._partial_size = len(rest)
        self._needed = needed

    def _read_frames(self, data: bytes, pos: int) -> int:
        """Handle each whole frame in ``data`` from ``pos``; where the first partial one starts."""
        view = memoryview(data)
        size = len(data)
        while size - pos >= 9 and self.transport is not None:
            head = int.from_bytes(data[pos : pos + 9], "big")
            length = head >> 48
            if length > MAX_FRAME:
                raise ProtocolError(FRAME_SIZE_ERROR, "frame larger than SETTINGS_MAX_FRAME_SIZE")
            end = pos + 9 + length
            if end > size:
                kind, flags = head >> 40 & 0xFF, head >> 32 & 0xFF
                if kind == DATA and length >= _STREAM_FRAME and not flags & PADDED:
                    if self._continuing is not None:
                        raise ProtocolError(PROTOCOL_ERROR, "expected CONTINUATION")
                    self._streaming = (head & 0x7FFFFFFF, flags, end - size)
                    self._data(flags & ~END_STREAM, head & 0x7FFFFFFF, view[pos + 9 :])
                    return size
                break
            self._frame(
                head >> 40 & 0xFF, head >> 32 & 0xFF, head & 0x7FFFFFFF, view[pos + 9 : end]
            )
            pos = end
        return pos

    def _stream_piece(self, data: bytes) -> int:
        """Hand on the next piece of the DATA frame arriving piece by piece; how many bytes
        of ``data`` it took (the next frame starts there)."""
        assert self._streaming is not None
        stream_id, flags, remaining = self._streaming
        take = min(remaining, len(data))
        remaining -= take
        self._streaming = (stream_id, flags, remaining) if remaining else None
        piece = memoryview(data)[:take] if take < len(data) else memoryview(data)
        self._data(flags if not remaining else flags & ~END_STREAM, stream_id, piece)
        return take

    # -- frames in ------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._continuing is not None and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise ProtocolError(FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, bytes(payload)))
        elif kind == RST_STREAM:
            if (stream := self.streams.pop(stream_id, None)) is not None:
                self.sender.blocked.pop(stream_id, None)
                stream.wake()
                self.stream_reset(stream_id)
        elif kind == GOAWAY:
            self.going_away = True
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored

    def _strip(self, flags: int, payload: memoryview) -> memoryview:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ProtocolError(PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : len(payload) - payload[0]]
        return payload

    def _data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        self._recv_pending += len(payload)
        if self._recv_pending >= _REPLENISH:
            self._write(frame(WINDOW_UPDATE, 0, 0, self._recv_pending.to_bytes(4, "big")))
            self._recv_pending = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # a stream we already answered or reset: its data is dropped
        stream.recv_pending += len(payload)
        self.stream_data(stream_id, self._strip(flags, payload), bool(flags & END_STREAM))
        if stream.recv_pending >= _STREAM_REPLENISH and not self.holding(stream_id):
            self.give_back(stream_id)

    def holding(self, stream_id: int) -> bool:
        """Whether what arrived on the stream waits to be taken: its window is not given
        back until :meth:`give_back` (a reader that does not keep up holds back its writer)."""
        return False

    def give_back(self, stream_id: int) -> None:
        """Let the client send as much again as it has sent since the last time."""
        stream = self.streams.get(stream_id)
        if stream is not None and stream.recv_pending >= _STREAM_REPLENISH:
            self._write(frame(WINDOW_UPDATE, 0, stream_id, stream.recv_pending.to_bytes(4, "big")))
            stream.recv_pending = 0

    def _headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        payload = self._strip(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if not stream_id % 2:
            raise ProtocolError(PROTOCOL_ERROR, "HEADERS on an even stream")
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id <= self.last_stream_id:
                self._decode(payload, flags)  # keep the decoder's table in step; drop it
                return
            self.last_stream_id = stream_id
            stream = self.streams[stream_id] = StreamState(stream_id, self._peer_window)
            if self.going_away:  # a stream after our GOAWAY is refused
                del self.streams[stream_id]
                self._decode(payload, flags)
                self._write(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
                return
        stream.header_block = bytearray(payload)
        self._continuing = stream
        self._flags = flags
        if flags & END_HEADERS:
            self._end_headers(stream)

    def _continuation(self, flags: int, stream_id: int, payload: memoryview) -> None:
        stream = self._continuing
        if stream is None or stream.stream_id != stream_id or stream.header_block is None:
            raise ProtocolError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        stream.header_block += payload
        if len(stream.header_block) > MAX_HEADER_BLOCK:
            raise ProtocolError(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self._end_headers(stream)

    def _end_headers(self, stream: StreamState) -> None:
        block, stream.header_block, self._continuing = stream.header_block, None, None
        headers = self._decode(bytes(block or b""), END_HEADERS)
        end_stream = bool(self._flags & END_STREAM)
        if headers and headers[0][0].startswith(":"):
            self.stream_opened(stream.stream_id, headers, end_stream)
        elif end_stream:  # trailers from the client: the end of its messages
            self.stream_data(stream.stream_id, b"", True)

    def _decode(self, block: bytes | memoryview, flags: int) -> Headers:
        try:
            return self._decoder.decode(bytes(block))
        except hpack_codec.HpackError as exc:
            raise ProtocolError(COMPRESSION_ERROR, f"bad header block: {exc}") from None

    def _settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if flags & ACK:
            return
        if stream_id or len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "bad SETTINGS")
        for at in range(0, len(payload), 6):
            key = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if key == _SETTING_INITIAL_WINDOW:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "initial window too large")
                for stream in self.streams.values():
                    stream.send_window += value - self._peer_window
                self._peer_window = value
            elif key == _SETTING_MAX_FRAME:
                self.sender.max_frame = max(16384, min(value, MAX_FRAME))
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            self.sender.window += increment
            self._flush_blocked()
        elif (stream := self.streams.get(stream_id)) is not None:
            stream.send_window += increment
            self._flush(stream)

    # -- ending the connection ------------------------------------------------------------
    def go_away(self) -> None:
        """Tell the client to open no more streams; the open ones go on."""
        if not self.going_away:
            self.going_away = True
            self._write(frame(GOAWAY, 0, 0, self.last_stream_id.to_bytes(4, "big") + bytes(4)))

    def _go_away(self, code: int, reason: str) -> None:
        payload = self.last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big")
        self._write(frame(GOAWAY, 0, 0, payload + reason.encode()[:256]))
        self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.close()
