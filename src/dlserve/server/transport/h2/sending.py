"""The sending side of an HTTP/2 connection (mixed into ``h2.Connection``): DATA goes out
as the client's windows allow, the rest of a stream waits in its queue, and a producer may
wait while more than ``HIGH_WATER`` bytes of its stream are queued."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

from dlserve.server.transport.h2.frames import (
    END_HEADERS,
    END_STREAM,
    HEADERS,
    HIGH_WATER,
    RST_STREAM,
    StreamState,
    bytes_view,
    frame,
)


class Sending:
    """Mixed into Connection, which provides these."""

    transport: asyncio.Transport | None
    streams: dict[int, StreamState]
    _send_window: int
    _peer_max_frame: int
    _blocked: dict[int, StreamState]

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def send(
        self, stream_id: int, head: bytes, data: Sequence[memoryview | bytes] = (),
        tail: bytes | None = None,
    ) -> None:  # fmt: skip
        """Send on a stream: ``head`` (frames that need no window, already built), then
        ``data`` as DATA frames as the windows allow, then ``tail`` (a header block, sent
        as trailers with END_STREAM). The stream ends with ``tail``."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ended or self.transport is None:
            return
        data = [bytes_view(piece) for piece in data]
        size = sum(len(piece) for piece in data)
        if not stream.out and size <= min(self._send_window, stream.send_window,
                                          self._peer_max_frame):  # fmt: skip
            out: list[bytes | memoryview] = [head] if head else []
            if size:
                self._send_window -= size
                stream.send_window -= size
                out.append((size << 48 | stream_id).to_bytes(9, "big"))  # a DATA frame
                out.extend(data)
            if tail is not None:
                out.append(frame(HEADERS, END_STREAM | END_HEADERS, stream_id, tail))
                self._end(stream)
            self.transport.writelines(out)
            return
        if head:
            stream.out.append((head,))
        stream.out.extend(memoryview(piece) for piece in data if len(piece))
        stream.queued += size
        if tail is not None:
            stream.out.append((frame(HEADERS, END_STREAM | END_HEADERS, stream_id, tail),))
        self._flush(stream)

    async def drained(self, stream_id: int) -> None:
        """Wait while more than ``HIGH_WATER`` bytes of the stream wait for the client's
        window: a producer (a streaming call's responses) goes no faster than its reader."""
        stream = self.streams.get(stream_id)
        while stream is not None and stream.queued > HIGH_WATER and self.transport is not None:
            stream.drain_waiter = asyncio.get_running_loop().create_future()
            await stream.drain_waiter

    def stop_reading(self, stream_id: int) -> None:
        """After the response has gone: tell a client still sending that we need no more
        (RST_STREAM NO_ERROR, RFC 9113 8.1). Not while the response still waits for window."""
        if stream_id not in self.streams:
            self._write(frame(RST_STREAM, 0, stream_id, bytes(4)))

    def _end(self, stream: StreamState) -> None:
        """We have sent the stream's END_STREAM: it is gone."""
        stream.ended = True
        self._blocked.pop(stream.stream_id, None)
        self.streams.pop(stream.stream_id, None)
        stream.wake()

    def _flush(self, stream: StreamState) -> None:
        out: list[bytes | memoryview] = []
        queue = stream.out
        while queue:
            piece = queue[0]
            if isinstance(piece, tuple):
                queue.popleft()
                out.append(piece[0])
                if piece[0][3] == HEADERS and piece[0][4] & END_STREAM:
                    self._end(stream)
                continue
            budget = min(self._send_window, stream.send_window, self._peer_max_frame)
            if budget <= 0:
                self._blocked[stream.stream_id] = stream
                break
            pieces: list[memoryview] = []
            size = 0
            while queue and not isinstance(queue[0], tuple) and size < budget:
                view = cast(memoryview, queue.popleft())
                if size + len(view) > budget:
                    queue.appendleft(view[budget - size :])
                    view = view[: budget - size]
                pieces.append(view)
                size += len(view)
            self._send_window -= size
            stream.send_window -= size
            stream.queued -= size
            out.append((size << 48 | stream.stream_id).to_bytes(9, "big"))
            out.extend(pieces)
        if out and self.transport is not None:
            self.transport.writelines(out)
        if stream.queued <= HIGH_WATER:
            stream.wake()

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                return
            del self._blocked[stream.stream_id]
            self._flush(stream)
