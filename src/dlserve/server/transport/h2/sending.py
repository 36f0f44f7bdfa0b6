"""The sending side of an HTTP/2 connection, an object its ``Connection`` owns: DATA goes
out as the client's windows allow, the rest of a stream waits in its queue, and a producer
may wait while more than ``HIGH_WATER`` bytes of its stream are queued.

It writes to an :class:`Output` (asyncio's transport, or a test's recorder) and never
reads: the connection tells it what the client's frames changed (windows, settings)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol, cast

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


class Output(Protocol):
    """Where a connection's bytes go: an asyncio transport has these three."""

    def write(self, data: bytes, /) -> None: ...

    def writelines(self, data: list[bytes | memoryview], /) -> None: ...

    def close(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Sender:
    """What a connection sends, within the windows the client gives."""

    __slots__ = ("blocked", "corked", "ended", "max_frame", "output", "sent", "streams", "window")

    def __init__(
        self, streams: dict[int, StreamState], ended: Callable[[StreamState], None],
    ) -> None:  # fmt: skip
        self.output: Output | None = None  # None before the connection is made and after
        self.streams = streams  # the connection's open streams: the same dict
        self.ended = ended  # the connection's: a stream we ended is closed
        self.sent = 0  # sends and flushes: keepalive and the ping policy see data going out
        self.window = 65535  # the connection's window for what we send
        self.max_frame = 16384  # the client's SETTINGS_MAX_FRAME_SIZE
        self.blocked: dict[int, StreamState] = {}  # streams waiting for window
        # what is sent while the connection reads frames: one write when it is done
        self.corked: list[bytes | memoryview] | None = None

    def cork(self) -> None:
        """Hold what is sent until :meth:`uncork`: the answers to the frames of one read
        (SETTINGS and PING ACKs, WINDOW_UPDATEs, RST_STREAMs) go out in one system call,
        not one each."""
        if self.corked is None:
            self.corked = []

    def uncork(self) -> None:
        corked, self.corked = self.corked, None
        if corked and self.output is not None:
            self.output.writelines(corked)

    def write(self, data: bytes) -> None:
        if self.corked is not None:
            self.corked.append(data)
        elif self.output is not None:
            self.output.write(data)

    def _writelines(self, parts: list[bytes | memoryview]) -> None:
        if self.corked is not None:
            self.corked.extend(parts)
        elif self.output is not None:
            self.output.writelines(parts)

    def send(
        self, stream_id: int, head: bytes, data: Sequence[memoryview | bytes] = (),
        tail: bytes | None = None,
    ) -> None:  # fmt: skip
        """Send on a stream: ``head`` (frames that need no window, already built), then
        ``data`` as DATA frames as the windows allow, then ``tail`` (a header block, sent
        as trailers with END_STREAM). The stream ends with ``tail``."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ended or self.output is None:
            return
        self.sent += 1
        data = [bytes_view(piece) for piece in data]
        size = sum(len(piece) for piece in data)
        if not stream.out and size <= min(self.window, stream.send_window, self.max_frame):
            out: list[bytes | memoryview] = [head] if head else []
            if size:
                self.window -= size
                stream.send_window -= size
                out.append((size << 48 | stream_id).to_bytes(9, "big"))  # a DATA frame
                out.extend(data)
            if tail is not None:
                out.append(frame(HEADERS, END_STREAM | END_HEADERS, stream_id, tail))
                self._end(stream)
            self._writelines(out)
            return
        if head:
            stream.out.append((head,))
        stream.out.extend(memoryview(piece) for piece in data if len(piece))
        stream.queued += size
        if tail is not None:
            stream.out.append((frame(HEADERS, END_STREAM | END_HEADERS, stream_id, tail),))
        self.flush(stream)

    async def drained(self, stream_id: int) -> None:
        """Wait while more than ``HIGH_WATER`` bytes of the stream wait for the client's
        window: a producer (a streaming call's responses) goes no faster than its reader."""
        stream = self.streams.get(stream_id)
        while stream is not None and stream.queued > HIGH_WATER and self.output is not None:
            stream.drain_waiter = asyncio.get_running_loop().create_future()
            await stream.drain_waiter

    def stop_reading(self, stream_id: int) -> None:
        """After the response has gone: tell a client still sending that we need no more
        (RST_STREAM NO_ERROR, RFC 9113 8.1). Not while the response still waits for window."""
        if stream_id not in self.streams:
            self.write(frame(RST_STREAM, 0, stream_id, bytes(4)))

    def _end(self, stream: StreamState) -> None:
        """We have sent the stream's END_STREAM: it is gone."""
        stream.ended = True
        self.blocked.pop(stream.stream_id, None)
        self.streams.pop(stream.stream_id, None)
        stream.wake()
        self.ended(stream)

    def flush(self, stream: StreamState) -> None:
        """Send what of the stream's queue the windows allow now."""
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
            budget = min(self.window, stream.send_window, self.max_frame)
            if budget <= 0:
                self.blocked[stream.stream_id] = stream
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
            self.window -= size
            stream.send_window -= size
            stream.queued -= size
            out.append((size << 48 | stream.stream_id).to_bytes(9, "big"))
            out.extend(pieces)
        if out and self.output is not None:
            self.sent += 1
            self._writelines(out)
        if stream.queued <= HIGH_WATER:
            stream.wake()

    def flush_blocked(self) -> None:
        """The connection's window grew: streams that waited for it go on."""
        for stream in list(self.blocked.values()):
            if self.window <= 0:
                return
            del self.blocked[stream.stream_id]
            self.flush(stream)

    def close(self) -> None:
        """The connection is gone: nothing more is written."""
        self.output = None
        self.corked = None
        self.blocked.clear()
