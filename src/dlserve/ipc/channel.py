"""Frame transport over a connected Unix stream socket.

:class:`BlockingChannel` is the worker's side (one thread, blocking calls);
:class:`AsyncChannel` is the server's side (an asyncio Protocol on the loop).
A frame whose header cannot be read does not end the connection: ``recv`` raises
``codec.UnreadableFrame`` for it (the next ``recv`` reads the frame after it), and the
async side hands it to ``on_unreadable``. A frame that cannot be encoded is never
partly written (``codec.UnencodableFrame``, raised before any byte is sent).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

from dlserve.ipc import codec, messages
from dlserve.tensors import mappings

T = TypeVar("T")
READ_AHEAD = 64 * 1024
_MAX_BUFFERS = 900  # below IOV_MAX (1024), with room for one more frame's pieces
Frame = tuple[T, memoryview]


class ChannelClosed(Exception):
    """The other side closed the connection."""


class BlockingChannel(Generic[T]):
    """Blocking send/receive of frames; payloads land in fresh writable buffers."""

    def __init__(self, sock: socket.socket, decoder: codec.Decoder[T], spin_ns: int = 0) -> None:
        self._sock = sock
        self._decoder = decoder
        # Poll this long for the next bytes before sleeping in recv: a sleeping process
        # takes tens of microseconds (more from a deep idle state) to wake up.
        self.spin_ns = spin_ns
        self._buf = bytearray(READ_AHEAD)
        self._start = 0  # first unread byte of _buf
        self._end = 0  # end of the bytes received into _buf

    def send(self, message: messages._Msg, payload: Sequence[bytes | memoryview] = ()) -> None:
        buffers, total = codec.encode_sized(message, payload)
        sent = self._sock.sendmsg(buffers)
        if sent < total:
            self._send_rest(buffers, sent)

    def send_many(
        self, frames: Sequence[tuple[messages._Msg, Sequence[bytes | memoryview]]]
    ) -> None:
        """Several frames in one system call (the replies of one batch: the server wakes
        once for them all). All are encoded before any is sent."""
        encoded = [codec.encode_sized(message, payload) for message, payload in frames]
        buffers: list[bytes | memoryview] = []
        total = 0
        for pieces, size in encoded:
            buffers += pieces
            total += size
            if len(buffers) > _MAX_BUFFERS:  # sendmsg takes at most IOV_MAX (1024) buffers
                self._send_all(buffers, total)
                buffers, total = [], 0
        if buffers:
            self._send_all(buffers, total)

    def _send_all(self, buffers: list[bytes | memoryview], total: int) -> None:
        sent = self._sock.sendmsg(buffers)
        if sent < total:
            self._send_rest(buffers, sent)

    def _send_rest(self, buffers: list[bytes | memoryview], sent: int) -> None:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            if sent >= view.nbytes:
                sent -= view.nbytes
                continue
            self._sock.sendall(view[sent:])
            sent = 0

    def recv(self) -> Frame[T]:
        """The next frame. Small frames cost one recv syscall (read ahead into a buffer);
        a large one is received straight into its own buffer."""
        if self._end - self._start < codec.PREFIX_SIZE:
            self._fill(codec.PREFIX_SIZE)
        header_len, payload_len = codec.PREFIX.unpack_from(self._buf, self._start)
        size = header_len + payload_len
        if codec.PREFIX_SIZE + size <= len(self._buf):
            if self._end - self._start < codec.PREFIX_SIZE + size:
                self._fill(codec.PREFIX_SIZE + size)  # may move the bytes to the front
            head = self._start + codec.PREFIX_SIZE
            self._start = head + size
            # the header is decoded in place; the payload is copied into its own buffer
            payload = memoryview(self._buf[head + header_len : head + size])
            return self._frame(memoryview(self._buf)[head : head + header_len], payload)
        head = self._start + codec.PREFIX_SIZE
        body = bytearray(size)
        buffered = self._end - head
        body[:buffered] = memoryview(self._buf)[head : self._end]
        self._start = self._end = 0
        self._recv_exactly(memoryview(body)[buffered:])
        view = memoryview(body)
        return self._frame(view[:header_len], view[header_len:])

    def _frame(self, header: memoryview, payload: memoryview) -> Frame[T]:
        """The decoded frame (it has been consumed: an UnreadableFrame carries its payload)."""
        try:
            return self._decoder.decode(header), payload
        except codec.UnreadableFrame as exc:
            exc.payload = payload
            raise

    def buffered(self) -> bool:
        """Whether bytes of a next frame were already read (select() would not see them)."""
        return self._end > self._start

    def read_ahead(self) -> bool:
        """Whether :meth:`recv` has bytes to start on without waiting: some read ahead
        already, or read now without blocking (the end of the stream counts: ``recv``
        raises ChannelClosed). For a reader that watches several channels by polling
        them in turn: what arrives is read by the same system call that finds it."""
        if self._end > self._start:
            return True
        self._start = self._end = 0
        try:
            n = self._sock.recv_into(self._buf, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        self._end = n  # 0: the stream ended, and recv says so
        return True

    def _fill(self, count: int) -> None:
        """Make at least ``count`` bytes available from ``_start`` (count <= buffer size)."""
        if self._end - self._start >= count:
            return
        if self._start + count > len(self._buf):
            pending = self._end - self._start
            self._buf[:pending] = self._buf[self._start : self._end]
            self._start, self._end = 0, pending
        view = memoryview(self._buf)
        while self._end - self._start < count:
            n = self._recv_into(view[self._end :])
            if n == 0:
                raise ChannelClosed("connection closed")
            self._end += n

    def _recv_into(self, view: memoryview) -> int:
        if self.spin_ns:
            deadline = time.perf_counter_ns() + self.spin_ns
            while True:
                try:
                    return self._sock.recv_into(view, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter_ns() > deadline:
                        break
                    os.sched_yield()  # whoever else is runnable on this CPU goes first
        return self._sock.recv_into(view)

    def _recv_exactly(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ChannelClosed("connection closed")
            got += n

    def fileno(self) -> int:
        """The socket's descriptor, to wait for a frame with a deadline (select)."""
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()


class AsyncChannel(asyncio.BufferedProtocol, Generic[T]):
    """Server-side protocol: parses frames and hands each to ``on_frame``, or one whose
    header cannot be read to ``on_unreadable``.

    A frame larger than the receive buffer is received into a buffer of its own (anonymous
    memory, its pages untouched until the kernel writes them), its payload a view of it: on
    the event loop, growing the receive buffer to 1 GiB and copying the payload out of it
    would hold every other client for most of a second, and keep the memory for good. A
    buffer of 32 MiB or more is given back to the kernel by a thread (``mappings.py``).
    """

    def __init__(
        self,
        decoder: codec.Decoder[T],
        on_frame: Callable[[T, memoryview], None],
        on_closed: Callable[[Exception | None], None],
        on_unreadable: Callable[[codec.UnreadableFrame], None],
    ) -> None:
        self._decoder = decoder
        self._on_frame = on_frame
        self._on_closed = on_closed
        self._on_unreadable = on_unreadable
        self._transport: asyncio.WriteTransport | None = None
        self._buf = bytearray(256 * 1024)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of received data
        self._large: memoryview | None = None  # a large frame's own buffer, while it comes
        self._large_end = 0  # end of what has come of it

    # -- asyncio.BufferedProtocol -------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.WriteTransport, transport)  # uvloop's is no subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._large is not None:  # no more than the frame: what follows is another's
            return self._large[self._large_end :]
        if self._end == len(self._buf):
            self._make_room(max(sizehint, 65536))
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._large is not None:
            self._large_end += nbytes
            if self._large_end == len(self._large):
                self._large_received()
            return
        self._end += nbytes
        self._parse()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._on_closed(exc)

    # -- frames ------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._buf
        while self._end - self._start >= codec.PREFIX_SIZE:
            header_len, payload_len = codec.PREFIX.unpack_from(buf, self._start)
            frame_end = self._start + codec.PREFIX_SIZE + header_len + payload_len
            if frame_end > self._end:
                if frame_end - self._start > len(buf):
                    self._receive_large(frame_end - self._start)
                return
            head = self._start + codec.PREFIX_SIZE
            # the payload is copied out so the receive buffer can be reused at once
            payload = memoryview(buf[head + header_len : frame_end])
            self._start = frame_end
            try:
                message = self._decoder.decode(memoryview(buf)[head : head + header_len])
            except codec.UnreadableFrame as exc:
                exc.payload = payload
                self._on_unreadable(exc)
                continue
            self._on_frame(message, payload)
        if self._start == self._end:
            self._start = self._end = 0

    def _receive_large(self, size: int) -> None:
        """The frame that begins at ``_start`` (``size`` bytes) is received into a buffer
        of its own; the receive buffer, empty, waits for the frames after it."""
        if size >= mappings.UNMAP_ON_THREAD:  # given back by a thread, not the loop
            large = mappings.mapped(size)
        else:
            large = memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE))
        got = self._end - self._start
        large[:got] = memoryview(self._buf)[self._start : self._end]
        self._start = self._end = 0
        self._large, self._large_end = large, got

    def _large_received(self) -> None:
        large = self._large
        assert large is not None
        self._large = None
        head = codec.PREFIX_SIZE
        end = head + codec.PREFIX.unpack_from(large)[0]
        payload = large[end:]  # a view: the frame's buffer is its own
        try:
            message = self._decoder.decode(large[head:end])
        except codec.UnreadableFrame as exc:
            exc.payload = payload
            self._on_unreadable(exc)
            return
        self._on_frame(message, payload)

    def _make_room(self, needed: int) -> None:
        pending = self._buf[self._start : self._end]
        size = max(len(self._buf), needed + len(pending))
        if size > len(self._buf):
            self._buf = bytearray(size)
        self._buf[: len(pending)] = pending
        self._start, self._end = 0, len(pending)

    def send(self, message: messages._Msg, payload: Sequence[bytes | memoryview] = ()) -> None:
        if self._transport is None:
            raise ChannelClosed("worker connection is closed")
        self._transport.writelines(codec.encode(message, payload))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
