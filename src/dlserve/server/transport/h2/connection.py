"""The HTTP/2 that gRPC needs, server side (RFC 9113): one connection's state machine.

It is driven by three calls and nothing else: ``connection_made(output)``,
``data_received(bytes)`` (any cut of the client's bytes) and ``connection_lost()``; what it
sends goes to ``output`` (``sending.Output``). asyncio makes these calls with a socket's
transport, as for any ``asyncio.Protocol``; a test makes them with bytes and a recorder,
no socket. Frames are parsed straight out of the bytes given and a request's response
leaves in one ``writelines``: no thread, no queue between.

What it does: the connection preface and SETTINGS (both ways), PING answered at once,
HEADERS with CONTINUATION, padding and priority (header blocks: ``hpack_codec.py``; the
request's fields checked as RFC 9113 8.3 says: ``messages.py``), DATA, flow control both
ways, RST_STREAM, GOAWAY both ways. Not: server push, priority scheduling, h2c upgrade;
TLS is the output's.

What it allows the client is in its ``Limits`` (``limits.py``), advertised in its
SETTINGS and enforced: the frame size, concurrent streams, the header list's size. Every
frame is checked as RFC 9113 section 6 says for its type, and against the stream's state
(5.1): a connection error is a GOAWAY with its code and the end of the connection, a
stream error an RST_STREAM. Receiving: a stream's window is ``STREAM_WINDOW``, the
connection's ``CONNECTION_WINDOW``; DATA past either is FLOW_CONTROL_ERROR, never kept.
A stream's window is given back as its messages are taken (a subclass may hold it back:
:meth:`Connection.holding`), the connection's as its streams' are, or end. DATA frames
just like the one before them in a read (one stream, one length, no flag: a message cut
into frames of the largest size) are a run of up to 16: checked, counted and handed on
together (:meth:`Connection.stream_frames`), with what one by one would do where a frame
of it errs or its stream ends during it. Floods of cheap frames (rapid reset, SETTINGS,
PING, empty frames) spend per-second budgets; past them the client gets GOAWAY
ENHANCE_YOUR_CALM. A connection's frames are handled for about ``TURN_S`` of the loop's
time at most (``turns.py``), then the rest waits for the loop's next turn with reading
paused (the time is counted across reads, and reading also pauses for a turn after each
``_BYTES_PER_TURN`` read); reading resumes at the turn after the rest's. A read of
``_BULK_READ`` or more (an upload's) is not handled when it comes but two hops of the
loop's ready queue later, behind whatever the loop's poll woke with it (a worker's reply,
another client's request). So a connection gets one turn per turn of the loop, from its
socket or from what a read left, never holds the loop for long, whatever its frames
cost, and an upload's turns come after the work they would have delayed. One that has
spent half a flood budget, or whose reads were mostly DATA the server drops, waits
``_SPENDING_WAIT_S`` for its next turn. Keepalive PINGs, the client's PING strikes and the
idle timeout run on the loop's timers (``call_later``), one handle each per connection.

Sending is the ``Sender``'s (``sending.py``), which the connection owns: DATA waits for
the client's windows, and a producer may wait while a stream has more than
``HIGH_WATER`` bytes queued (``drained``).

``Connection`` knows nothing of gRPC: the subclass in ``grpc/rpc.py`` gets
:meth:`Connection.stream_opened`, :meth:`~Connection.stream_data`,
:meth:`~Connection.stream_reset`, :meth:`~Connection.headers_too_large` and
:meth:`~Connection.closed` calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final, cast

from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONNECTION_WINDOW,
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
    MAX_WINDOW,
    MIN_FRAME,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    STREAM_WINDOW,
    WINDOW_UPDATE,
    ProtocolError,
    StreamState,
    frame,
)
from dlserve.server.transport.h2.hpack_codec import HeaderListTooLarge, Headers
from dlserve.server.transport.h2.limits import Budget, Limits
from dlserve.server.transport.h2.messages import Malformed, request_length, trailers_ok
from dlserve.server.transport.h2.sending import Output, Sender
from dlserve.server.transport.turns import TURN_S, clock

log = logging.getLogger("dlserve.grpc")

_STREAM_FRAME: Final = 256 * 1024  # DATA frames this large are handed on as they arrive
_STREAM_REPLENISH: Final = STREAM_WINDOW // 2
_CHECK_EVERY: Final = 8  # frames (weighed as below) handled between two looks at the clock
# frames of a read handled before the first look (so a request's HEADERS and its DATA,
# or its window's WINDOW_UPDATE, written together are handled together)
_FIRST_CHECK: Final = 2 * _CHECK_EVERY
# a connection that has spent half a flood budget (or sends what is dropped) waits this
# long for its next turn: a tenth of the loop at most, however fast it writes
_SPENDING_WAIT_S: Final = 1e-3
# bytes read from one connection between two pauses of its reading for a turn of the
# loop: the loop reads a ready socket up to 32 times in one turn (libuv), 8 MiB at full
# speed, before it serves anyone else; its copies of what it read are not in TURN_S
_BYTES_PER_TURN: Final = 1 << 18
# a read this large is an upload's: handled at a later turn of the loop, behind what the
# loop's poll woke with it (a worker's reply, another client's request); smaller reads (a
# request or few) are handled as they come
_BULK_READ: Final = 1 << 16
_HEADERS_WEIGHT: Final = 8  # a HEADERS frame (a new call) counts as this many frames
_DATA_WEIGHT: Final = 2  # and a DATA frame (its copy, a look at the message) as this many
_CLOSED_KEPT: Final = 256  # closed streams remembered: which ones a late frame may name
# DATA frames just like the one before them (same length, stream, no flags) handled with it
# as one run, at most this many more: a 256 KiB run of 16 KiB frames at most
_RUN_FRAMES: Final = 15
_SMALL_DATA: Final = 1024  # what a DATA frame costs at least of a stream's in-flight allowance
_ENABLE_PUSH, _MAX_CONCURRENT, _INITIAL_WINDOW, _MAX_FRAME, _MAX_LIST = 0x2, 0x3, 0x4, 0x5, 0x6
_KEEPALIVE_PING: Final = b"dlserve\x00"  # the opaque data of our keepalive PINGs
_IDLE_CLIENT_PING_S: Final = 7200.0  # gRPC core's allowed PING interval with no calls


def _setting(key: int, value: int) -> bytes:
    return key.to_bytes(2, "big") + value.to_bytes(4, "big")


def _code(code: int) -> bytes:
    return code.to_bytes(4, "big")


class Connection(asyncio.Protocol):
    """One HTTP/2 connection. Subclasses answer the ``stream_*`` calls."""

    def __init__(self, limits: Limits = Limits()) -> None:  # noqa: B008 (frozen)
        self.limits = limits
        self.transport: Output | None = None
        self.streams: dict[int, StreamState] = {}
        self.sender = Sender(self.streams, self._stream_ended)
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
        self._dead = False  # a connection error was sent: nothing more is read
        self._turns: asyncio.AbstractEventLoop | None = None
        self._partial: list[bytes] = []  # the start of a frame still arriving
        self._partial_size = 0
        self._needed = 0  # bytes the partial frame needs in all
        self._backlog: list[bytes] | None = None  # bytes left for the loop's next turn
        self._read = 0  # bytes read since reading last paused for a turn (_BYTES_PER_TURN)
        self._spent = 0.0  # seconds of handling since then (TURN_S)
        self._dropped = 0  # bytes of DATA dropped since then (calls that had ended)
        self._turn_end = float("inf")  # when the turn under way is over (no loop: never)
        self._backlog_at = 0  # where in the first of them
        # a large DATA frame whose payload is handed on as it arrives, not joined first:
        # (stream id, its flags, payload bytes still to come)
        self._streaming: tuple[int, int, int] | None = None
        self._preface = False
        self._settled = False  # the client's first frame, its SETTINGS, has come
        self._max_frame = limits.max_frame_size
        self._max_streams = limits.max_concurrent_streams
        self._max_block = 2 * limits.max_header_list_size  # a header block, compressed
        self._decoder = hpack_codec.Decoder(4096, limits.max_header_list_size)
        self._peer_window = 65535  # the client's initial stream window for what we send
        self._recv_unacked = 0  # DATA bytes received and not given back to the connection
        self._recv_credit = 0  # of those, bytes taken (or dropped) and not yet given back
        # streams closed lately: True if a frame on one is STREAM_CLOSED (the client ended
        # or reset it), False if it is ignored (we reset it: RFC 9113 5.1 "closed")
        self._closed: dict[int, bool] = {}
        # of those we ended before the client did: the bytes it may still have on their way
        # (the rest of the window it had); DATA past them counts as a control frame
        self._in_flight: dict[int, int] = {}
        # a header block waiting for CONTINUATION: its stream (0: none), flags, bytes
        self._continuing = 0
        self._block_flags = 0
        self._block = bytearray()
        self._valid: Headers | None = None  # the last request header list found well-formed
        self._valid_length = -1
        self._resets = Budget(limits.max_resets_per_s)
        self._control = Budget(limits.max_control_frames_per_s)
        self._timers: list[asyncio.TimerHandle | None] = [None, None, None]  # alive, ack, idle
        self._pings_unanswered = 0  # keepalive PINGs sent with no data between
        self._data_seen = 0  # the sender's count when keepalive last looked
        self._strikes = 0
        self._last_ping = float("-inf")
        self._strike_seen = 0  # the sender's count when the ping policy last looked
        self._idle_seen = 0  # the last stream id when the idle timer last looked

    # -- for subclasses -------------------------------------------------------------------
    def stream_opened(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        raise NotImplementedError

    def stream_data(self, stream_id: int, data: memoryview | bytes, end_stream: bool) -> None:
        raise NotImplementedError

    def stream_frames(self, stream_id: int, frames: memoryview, length: int) -> int:
        """A run of DATA frames of the stream, none ending it, as they lay in the read:
        ``length`` bytes of payload after each 9-byte header (``frames[9 : 9 + length]``,
        then every ``9 + length`` bytes), counted against the windows already. How many
        it took: where the stream ended during the run (its reader reset it, or answered
        and ended it), the rest is handled as if each came after. Here: each payload to
        :meth:`stream_data`."""
        step = 9 + length
        for at in range(0, len(frames), step):
            if stream_id not in self.streams:
                return at // step
            self.stream_data(stream_id, frames[at + 9 : at + step], False)
        return len(frames) // step

    def stream_reset(self, stream_id: int) -> None:
        raise NotImplementedError

    def headers_too_large(self, stream_id: int, end_stream: bool) -> None:
        """A request's header list is past SETTINGS_MAX_HEADER_LIST_SIZE; the stream is
        open for an answer (HTTP's 431). Here: RST_STREAM REFUSED_STREAM."""
        self.reset_stream(stream_id, REFUSED_STREAM)

    def closed(self) -> None:
        """The connection is gone; every stream with it."""

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = self.sender.output = cast(Output, transport)
        limits = self.limits
        settings = _setting(_INITIAL_WINDOW, STREAM_WINDOW)
        if self._max_frame != MIN_FRAME:
            settings += _setting(_MAX_FRAME, self._max_frame)
        settings += _setting(_MAX_CONCURRENT, limits.max_concurrent_streams)
        settings += _setting(_MAX_LIST, limits.max_header_list_size)
        update = (CONNECTION_WINDOW - 65535).to_bytes(4, "big")
        self.transport.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, update))
        try:
            self._turns = asyncio.get_running_loop()
        except RuntimeError:  # driven by a test without a loop: no timers, no deferring
            return
        if limits.keepalive_time_ms > 0:
            self._timers[0] = self._later(limits.keepalive_time_ms, self._keepalive)
        if limits.max_connection_idle_ms > 0:
            self._timers[2] = self._later(limits.max_connection_idle_ms, self._idle_check)

    def _later(self, ms: int, callback: object) -> asyncio.TimerHandle:
        assert self._turns is not None
        return self._turns.call_later(ms / 1000, callback)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._dead = True
        for timer in self._timers:
            if timer is not None:
                timer.cancel()
        for stream in self.streams.values():
            self._drop(stream)
        self.streams.clear()
        self.sender.close()
        self.closed()

    def data_received(self, data: bytes) -> None:
        """Frames are parsed straight out of ``data``; a frame that arrives in pieces is
        joined once, when its last piece is in (one copy, whatever its size), except a large
        DATA frame, whose payload is handed on piece by piece as it arrives (no copy here)."""
        if self._backlog is not None:
            self._backlog.append(data)
            return
        if self._dead:
            return
        if self._turns is None:  # driven without a loop: no turns
            self._receive(data)
            return
        if len(data) >= _BULK_READ and self.transport is not None:
            self._backlog, self._backlog_at = [data], 0
            self.transport.pause_reading()
            self._turns.call_soon(self._turn_after, self._next_turn)  # two hops: behind
            return
        began = clock()
        self._turn_end = began + TURN_S - self._spent
        self._receive(data)
        self._spent += clock() - began
        self._read += len(data)
        if self._spent >= TURN_S or self._read >= _BYTES_PER_TURN:
            dropping = 2 * self._dropped > self._read
            self._spent, self._read, self._dropped = 0.0, 0, 0
            if self._backlog is None and self.transport is not None and not self._dead:
                self.transport.pause_reading()  # the loop's turn, then the next read
                self._turn_after(self._resume, dropping)

    def _resume(self) -> None:
        if self._backlog is None and self.transport is not None and not self._dead:
            self.transport.resume_reading()

    def _receive(self, data: bytes, pos: int = 0) -> None:
        """The frames of one read; what they are answered with goes out in one write."""
        self.sender.cork()
        try:
            self._take(data, pos)
        finally:
            self.sender.uncork()
        self.frames_handled()

    def frames_handled(self) -> None:
        """Frames of a read, or of what a read left for a later turn, were handled (a
        window may have grown, a stream ended). Here: nothing."""

    def _take(self, data: bytes, pos: int) -> None:
        try:
            while not self._dead:
                if self._streaming is not None:  # a large DATA frame's next piece
                    pos += self._stream_piece(data, pos)
                    if pos >= len(data):
                        return
                elif self._partial:  # a frame begun in an earlier read: only its rest joined
                    need = self._needed - self._partial_size
                    if len(data) - pos < need:
                        self._partial.append(data[pos:] if pos else data)
                        self._partial_size += len(data) - pos
                        return
                    piece = b"".join([*self._partial, data[pos : pos + need]])
                    pos += need
                    self._partial.clear()
                    self._frames(piece, 0)
                elif self._preface:
                    pos = self._read_frames(data, pos)
                    if pos < len(data) and self.transport is not None and not self._dead:
                        self._rest(data, pos)
                    return
                else:
                    self._frames(data, pos)
                    return
        except ProtocolError as exc:
            log.debug("HTTP/2 protocol error: %s", exc)
            self._go_away(exc.code, str(exc))

    def _frames(self, data: bytes, pos: int) -> None:
        """The preface, then the frames of ``data`` from ``pos``; what is left is kept."""
        if not self._preface:
            if len(data) - pos < len(PREFACE) and PREFACE.startswith(data[pos:]):
                self._keep(data[pos:], len(PREFACE))
                return
            if not data.startswith(PREFACE, pos):
                raise ProtocolError(PROTOCOL_ERROR, "not the HTTP/2 connection preface")
            self._preface = True
            pos += len(PREFACE)
        pos = self._read_frames(data, pos)
        if pos < len(data) and self.transport is not None and not self._dead:
            self._rest(data, pos)

    def _rest(self, data: bytes, pos: int) -> None:
        """The bytes of ``data`` from ``pos``, past the frames handled: a frame still
        arriving, or frames left for the loop's next turn (kept where they are: no copy)."""
        left = len(data) - pos
        if left < 9:
            self._keep(data[pos:], 9)
            return
        length = int.from_bytes(data[pos : pos + 3], "big")
        if length > self._max_frame:
            raise ProtocolError(FRAME_SIZE_ERROR, "frame larger than SETTINGS_MAX_FRAME_SIZE")
        if left < 9 + length or self._turns is None:
            self._keep(data[pos:], 9 + length)
            return
        self._leave([data], pos)

    def _leave(self, reads: list[bytes], pos: int) -> None:
        """``reads``, from ``pos`` in the first, for the loop's next turn."""
        self._backlog, self._backlog_at = reads, pos
        assert self.transport is not None
        self.transport.pause_reading()
        self._turn_after(self._next_turn)

    def _turn_after(self, callback: Callable[[], None], dropping: bool = False) -> None:
        """``callback`` at the loop's next turn; a while later if the connection is
        spending its flood budgets, or most of what it sent lately was dropped (DATA of
        calls that had ended: refused, reset, answered): others go first."""
        assert self._turns is not None
        if dropping or self._control.spending() or self._resets.spending():
            self._turns.call_later(_SPENDING_WAIT_S, callback)
        else:
            self._turns.call_soon(callback)

    def _next_turn(self) -> None:
        backlog, self._backlog = self._backlog, None
        if backlog is None or self._dead or self.transport is None:
            return
        self._spent, self._read, self._dropped = 0.0, 0, 0  # a turn of its own
        self._turn_end = clock() + TURN_S
        size, pos = 0, self._backlog_at
        self.sender.cork()  # what the frames are answered with goes out in one write
        try:
            for i, read in enumerate(backlog):  # more came before reading paused: each
                if i and clock() >= self._turn_end:  # read where it came, none joined
                    self._leave(backlog[i:], 0)  # the turn ended with the read before
                    break
                self._take(read, pos)
                size += len(read) - pos
                pos = 0
                if self._backlog is not None:  # the turn ended inside this read
                    self._backlog.extend(backlog[i + 1 :])
                    break
                if self._dead or self.transport is None:
                    break
        finally:
            self.sender.uncork()
        self.frames_handled()
        if self._backlog is None and self.transport is not None and not self._dead:
            # not at once: the loop's poll comes between
            self._turn_after(self._resume, 2 * self._dropped > size)

    def _keep(self, rest: bytes, needed: int) -> None:
        self._partial = [rest]
        self._partial_size = len(rest)
        self._needed = needed

    def _read_frames(self, data: bytes, pos: int) -> int:
        """Handle the whole frames in ``data`` from ``pos`` until the turn is over; where
        the first one not handled starts."""
        view = memoryview(data)
        size = len(data)
        check = _FIRST_CHECK
        max_frame = self._max_frame
        while size - pos >= 9 and not self._dead:
            head = int.from_bytes(data[pos : pos + 9], "big")
            length = head >> 48
            if length > max_frame:
                raise ProtocolError(FRAME_SIZE_ERROR, "frame larger than SETTINGS_MAX_FRAME_SIZE")
            end = pos + 9 + length
            kind, flags = head >> 40 & 0xFF, head >> 32 & 0xFF
            if end > size:
                if kind == DATA and length >= _STREAM_FRAME and not flags & PADDED:
                    self._stream_start(flags, head & 0x7FFFFFFF, length, view[pos + 9 :])
                    return size
                break
            if not self._settled or self._continuing:
                self._frame(kind, flags, head & 0x7FFFFFFF, view[pos + 9 : end])
            elif kind == DATA and not flags & PADDED:
                run = end
                if not flags and length:  # the whole frames just like it that follow: a run
                    last = min(size, end + _RUN_FRAMES * (9 + length)) - 9 - length
                    if run <= last:  # one may follow (no slice for the tag otherwise)
                        tag = data[pos : pos + 9]
                        while run <= last and data.startswith(tag, run):
                            run += 9 + length
                if run > end:
                    self._data_run(view[pos:run], head & 0x7FFFFFFF, length)
                    check = 0  # a run weighs as much as a look at the clock
                else:
                    stream = self._data_start(flags, head & 0x7FFFFFFF, length)  # the usual
                    if stream is not None:
                        self._hand_on(stream, view[pos + 9 : end], flags)
                end = run
            elif kind == HEADERS:
                self._headers(flags, head & 0x7FFFFFFF, view[pos + 9 : end])
            else:
                self._frame(kind, flags, head & 0x7FFFFFFF, view[pos + 9 : end])
            pos = end
            check -= _HEADERS_WEIGHT if kind == HEADERS else _DATA_WEIGHT if kind == DATA else 1
            if check <= 0:
                if clock() >= self._turn_end:
                    break
                check = _CHECK_EVERY
        return pos

    def _stream_start(self, flags: int, stream_id: int, length: int, first: memoryview) -> None:
        """A large DATA frame whose first ``first`` bytes are in: checked and counted whole
        now, its payload handed on as it arrives."""
        if self._continuing:
            raise ProtocolError(PROTOCOL_ERROR, "expected CONTINUATION")
        if not self._settled:
            raise ProtocolError(PROTOCOL_ERROR, "the client's first frame is not SETTINGS")
        stream = self._data_start(flags, stream_id, length)
        self._streaming = (stream_id if stream is not None else 0, flags, length - len(first))
        if stream is not None:
            self._hand_on(stream, first, flags & ~END_STREAM)

    def _stream_piece(self, data: bytes, pos: int) -> int:
        """Hand on the next piece (from ``pos``) of the DATA frame arriving piece by piece;
        how many bytes of ``data`` it took (the next frame starts there)."""
        assert self._streaming is not None
        stream_id, flags, remaining = self._streaming
        take = min(remaining, len(data) - pos)
        remaining -= take
        self._streaming = (stream_id, flags, remaining) if remaining else None
        stream = self.streams.get(stream_id) if stream_id else None
        if stream is not None:
            piece = memoryview(data)[pos : pos + take] if pos or take < len(data) else data
            self._hand_on(stream, piece, flags if not remaining else flags & ~END_STREAM)
        else:
            self._dropped += take
        return take

    # -- frames in ------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._continuing:
            if kind != CONTINUATION:
                raise ProtocolError(PROTOCOL_ERROR, "expected CONTINUATION")
            self._continuation(flags, stream_id, payload)
        elif not self._settled:
            if kind != SETTINGS or flags & ACK:
                raise ProtocolError(PROTOCOL_ERROR, "the client's first frame is not SETTINGS")
            self._settled = True
            self._settings(flags, stream_id, payload)
        elif kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == RST_STREAM:
            self._rst_stream(stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == PING:
            self._ping(flags, stream_id, payload)
        elif kind == PRIORITY:
            self._priority(stream_id, payload)
        elif kind == GOAWAY:
            self._goaway(stream_id, payload)
        elif kind == CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:  # a frame of an extension: ignored (RFC 9113 5.5)
            self._calm(self._control)

    def _calm(self, budget: Budget) -> None:
        if not budget.spend():
            raise ProtocolError(ENHANCE_YOUR_CALM, "too many frames of this kind")

    def _strip(self, flags: int, payload: memoryview) -> memoryview:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ProtocolError(PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : len(payload) - payload[0]]
        return payload

    # -- DATA -----------------------------------------------------------------------------
    def _data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        data = self._strip(flags, payload) if flags & PADDED else payload
        stream = self._data_start(flags, stream_id, len(payload))
        if stream is not None:
            self._hand_on(stream, data, flags)

    def _data_start(self, flags: int, stream_id: int, length: int) -> StreamState | None:
        """Check a DATA frame and count it against the windows; its stream, or None where
        its payload is not wanted (dropped, its window given back)."""
        if not stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        self._recv_unacked += length
        if self._recv_unacked > CONNECTION_WINDOW:
            raise ProtocolError(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_ended:
            self._unwanted(stream_id, stream, length)
            return None
        stream.recv_pending += length
        if stream.recv_pending > STREAM_WINDOW:
            raise ProtocolError(FLOW_CONTROL_ERROR, "DATA past the stream's window")
        if not length and not flags & END_STREAM:
            self._calm(self._control)
        return stream

    def _data_run(self, frames: memoryview, stream_id: int, length: int) -> None:
        """DATA frames of ``length`` bytes each, of one stream, no flags, as they lay in
        the read (headers and all): counted and handed on as one where that changes
        nothing the client can see (the windows and the stream's content-length hold them
        all, or they are the rest of a window the client had on a stream we ended), else
        one by one: one look-up, one count, one hand-on (``stream_frames``) for them all."""
        step = 9 + length
        count = len(frames) // step
        total = count * length
        stream = self.streams.get(stream_id)
        if self._recv_unacked + total <= CONNECTION_WINDOW:
            if (stream is not None and not stream.remote_ended and stream.expected < 0
                    and stream.recv_pending + total <= STREAM_WINDOW):  # fmt: skip
                frames = self._run_on(stream, frames, length, count)
            elif stream is None and self._in_flight.get(stream_id, 0) >= (
                cost := count * max(length, _SMALL_DATA)
            ):
                self._recv_unacked += total
                self._in_flight[stream_id] -= cost
                self._credit(total)
                self._dropped += total
                return
        for at in range(0, len(frames), step):  # a frame may be the one that errs
            if self._dead:
                return
            self._data(0, stream_id, frames[at + 9 : at + step])

    def _run_on(
        self, stream: StreamState, frames: memoryview, length: int, count: int
    ) -> memoryview:
        """Count the run with its open stream and hand it on; what is left of it where
        the stream ended during it (uncounted again: for the frame-by-frame path)."""
        total = count * length
        self._recv_unacked += total
        stream.recv_pending += total
        taken = self.stream_frames(stream.stream_id, frames, length)
        if taken < count:
            size = (count - taken) * length
            self._recv_unacked -= size
            if self.streams.get(stream.stream_id) is stream:
                stream.recv_pending -= size
            else:  # forgetting the stream gave their window back, or left them in flight
                self._recv_credit -= size
                if stream.stream_id in self._in_flight:
                    self._in_flight[stream.stream_id] += size
            return frames[taken * (9 + length) :]
        if stream.recv_pending >= _STREAM_REPLENISH and not self.holding(stream.stream_id):
            self.give_back(stream.stream_id)
        return frames[:0]

    def _unwanted(self, stream_id: int, stream: StreamState | None, length: int) -> None:
        if stream_id > self.last_stream_id or not stream_id % 2:
            raise ProtocolError(PROTOCOL_ERROR, "DATA on an idle stream")
        self._credit(length)
        self._dropped += length
        if stream is not None or self._closed.get(stream_id):
            self.reset_stream(stream_id, STREAM_CLOSED)  # half-closed (remote), or closed
            return
        # a stream we ended: its DATA still coming is dropped, free while the client may
        # have sent it before it heard (RFC 9113 5.1 "closed"), a control frame past that
        # (and an empty one always, as on an open stream)
        left = self._in_flight.get(stream_id, 0) - max(length, _SMALL_DATA)
        if length and left >= 0:
            self._in_flight[stream_id] = left
        else:
            self._in_flight.pop(stream_id, None)
            self._calm(self._control)

    def _hand_on(self, stream: StreamState, payload: memoryview | bytes, flags: int) -> None:
        end_stream = bool(flags & END_STREAM)
        if stream.expected >= 0:
            stream.expected -= len(payload)
            if stream.expected < 0 or (end_stream and stream.expected):
                self.reset_stream(stream.stream_id, PROTOCOL_ERROR)  # not its content-length
                return
        if end_stream:
            stream.remote_ended = True
        self.stream_data(stream.stream_id, payload, end_stream)
        if stream.recv_pending >= _STREAM_REPLENISH and not self.holding(stream.stream_id):
            self.give_back(stream.stream_id)

    def holding(self, stream_id: int) -> bool:
        """Whether what arrived on the stream waits to be taken: its window is not given
        back until :meth:`give_back` (a reader that does not keep up holds back its writer)."""
        return False

    def give_back(self, stream_id: int) -> None:
        """Let the client send as much again as it has sent since the last time."""
        stream = self.streams.get(stream_id)
        if stream is not None and stream.recv_pending >= _STREAM_REPLENISH:
            pending, stream.recv_pending = stream.recv_pending, 0
            self._write(frame(WINDOW_UPDATE, 0, stream_id, pending.to_bytes(4, "big")))
            self._credit(pending)

    def _credit(self, size: int) -> None:
        """``size`` bytes counted against the connection's window were taken or dropped:
        the window is given back once half of it is."""
        self._recv_credit += size
        if self._recv_credit >= CONNECTION_WINDOW // 2:
            credit, self._recv_credit = self._recv_credit, 0
            self._recv_unacked -= credit
            self._write(frame(WINDOW_UPDATE, 0, 0, credit.to_bytes(4, "big")))

    # -- HEADERS and CONTINUATION ---------------------------------------------------------
    def _headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & (PADDED | PRIORITY_FLAG):
            payload = self._strip(flags, payload)
            if flags & PRIORITY_FLAG:
                if len(payload) < 5:
                    raise ProtocolError(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
                if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                    flags |= PRIORITY_FLAG << 8  # depends on itself: a stream error, later
                payload = payload[5:]
        if not stream_id % 2:
            raise ProtocolError(PROTOCOL_ERROR, "HEADERS on an even stream")
        if flags & END_HEADERS:
            if stream_id > self.last_stream_id:  # the usual: a new stream's whole block
                self._open(stream_id, flags, bytes(payload))
            else:
                self._header_block(stream_id, flags, bytes(payload))
            return
        if len(payload) > self._max_block:
            raise ProtocolError(ENHANCE_YOUR_CALM, "header block too large")
        self._continuing, self._block_flags = stream_id, flags
        self._block = bytearray(payload)

    def _continuation(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id != self._continuing:
            raise ProtocolError(PROTOCOL_ERROR, "CONTINUATION of another stream")
        self._block += payload
        if len(self._block) > self._max_block:
            raise ProtocolError(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self._continuing = 0
            block, self._block = bytes(self._block), bytearray()
            self._header_block(stream_id, self._block_flags, block)
        elif len(payload) < 1024:
            self._calm(self._control)  # many small pieces of one block

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._trailers(stream, flags, block)
        elif stream_id <= self.last_stream_id:
            self._decode(block)  # keeps the decoder's table in step
            closed = self._closed.get(stream_id)
            if closed is None:
                raise ProtocolError(PROTOCOL_ERROR, "stream id not above the last one")
            if closed:
                raise ProtocolError(STREAM_CLOSED, "HEADERS on a closed stream")
        else:
            self._open(stream_id, flags, block)

    def _open(self, stream_id: int, flags: int, block: bytes) -> None:
        self.last_stream_id = stream_id
        end_stream = bool(flags & END_STREAM)
        headers = self._decode(block)
        if headers is None:  # past SETTINGS_MAX_HEADER_LIST_SIZE
            self._too_large(stream_id, end_stream)
            return
        if self.going_away or len(self.streams) >= self._max_streams:
            self._refuse_stream(stream_id)
            return
        if headers is not self._valid:
            try:
                self._valid_length = request_length(headers)
            except Malformed as exc:
                log.debug("HTTP/2 malformed request: %s", exc)
                self.reset_stream(stream_id, PROTOCOL_ERROR)
                return
            self._valid = headers
        if (flags >> 8 or self._valid_length >= 0) and not self._checked(
            stream_id, flags, end_stream
        ):
            return
        stream = self.streams[stream_id] = StreamState(stream_id, self._peer_window)
        stream.remote_ended = end_stream
        stream.expected = self._valid_length
        self.stream_opened(stream_id, headers, end_stream)

    def _checked(self, stream_id: int, flags: int, end_stream: bool) -> bool:
        """The rarer checks of a new stream: a priority on itself, a content-length."""
        if flags >> 8 or (end_stream and self._valid_length):
            self.reset_stream(stream_id, PROTOCOL_ERROR)
            return False
        return True

    def _too_large(self, stream_id: int, end_stream: bool) -> None:
        self._calm(self._resets)
        if self.going_away or len(self.streams) >= self._max_streams:
            self._refuse_stream(stream_id)
            return
        stream = self.streams[stream_id] = StreamState(stream_id, self._peer_window)
        stream.remote_ended = end_stream
        self.headers_too_large(stream_id, end_stream)

    def _refuse_stream(self, stream_id: int) -> None:
        """A new stream after our GOAWAY, or past SETTINGS_MAX_CONCURRENT_STREAMS, is
        refused (RFC 9113 5.1.2): the client may try it again."""
        self.reset_stream(stream_id, REFUSED_STREAM)

    def _trailers(self, stream: StreamState, flags: int, block: bytes) -> None:
        """A second header block on an open stream: the client's trailers."""
        headers = self._decode(block)
        stream_id = stream.stream_id
        if stream.remote_ended:
            self.reset_stream(stream_id, STREAM_CLOSED)
        elif headers is None:
            self.reset_stream(stream_id, ENHANCE_YOUR_CALM)
        elif not flags & END_STREAM or not trailers_ok(headers) or stream.expected > 0:
            self.reset_stream(stream_id, PROTOCOL_ERROR)
        else:
            stream.remote_ended = True
            self.stream_data(stream_id, b"", True)

    def _decode(self, block: bytes) -> Headers | None:
        """The header list; None if it is past SETTINGS_MAX_HEADER_LIST_SIZE."""
        try:
            return self._decoder.decode(block)
        except hpack_codec.HpackError as exc:
            raise ProtocolError(COMPRESSION_ERROR, f"bad header block: {exc}") from None
        except HeaderListTooLarge:
            return None

    # -- the other frames -----------------------------------------------------------------
    def _rst_stream(self, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
        if stream_id > self.last_stream_id or not stream_id % 2:
            raise ProtocolError(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            self._calm(self._control)
            return
        self._calm(self._resets)
        self.sender.blocked.pop(stream_id, None)
        self._drop(stream)
        self._forget(stream, True)
        self.stream_reset(stream_id)

    def reset_stream(self, stream_id: int, code: int) -> None:
        """A stream error: RST_STREAM with ``code``; the stream, if open, is gone."""
        self._calm(self._resets)
        self._write(frame(RST_STREAM, 0, stream_id, _code(code)))
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            self._remember(stream_id, False)
            return
        self.sender.blocked.pop(stream_id, None)
        self._drop(stream)
        self._forget(stream, False)
        self.stream_reset(stream_id)

    @staticmethod
    def _drop(stream: StreamState) -> None:
        """The stream is gone before what it queued could leave: let go of it now (a
        producer waiting on it may hold the stream a while longer)."""
        stream.ended = True
        stream.out.clear()
        stream.queued = 0
        stream.wake()

    def _stream_ended(self, stream: StreamState) -> None:
        """The sender ended the stream: a frame the client sends on it later is an error
        if the client had ended it too, else dropped (we send RST_STREAM NO_ERROR)."""
        self._forget(stream, stream.remote_ended)

    def _forget(self, stream: StreamState, closed: bool) -> None:
        if not closed and not stream.remote_ended:
            self._in_flight[stream.stream_id] = STREAM_WINDOW - stream.recv_pending
        if stream.recv_pending:
            self._credit(stream.recv_pending)
            stream.recv_pending = 0
        self._remember(stream.stream_id, closed)

    def _remember(self, stream_id: int, closed: bool) -> None:
        remembered = self._closed
        remembered[stream_id] = closed
        if len(remembered) > 2 * _CLOSED_KEPT:
            self._prune()

    def _prune(self) -> None:
        """Keep the latest ``_CLOSED_KEPT`` closed streams (ids only grow): in bulk, once
        twice as many are kept, so that a stream's end costs a dict's store."""
        remembered = self._closed
        for stream_id in sorted(remembered)[:-_CLOSED_KEPT]:
            del remembered[stream_id]
        self._in_flight = {k: v for k, v in self._in_flight.items() if k in remembered}

    def _priority(self, stream_id: int, payload: memoryview) -> None:
        if not stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "PRIORITY on stream 0")
        self._calm(self._control)
        if len(payload) != 5:
            self.reset_stream(stream_id, FRAME_SIZE_ERROR)
        elif int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
            self.reset_stream(stream_id, PROTOCOL_ERROR)

    def _goaway(self, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise ProtocolError(FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
        self._calm(self._control)
        self.going_away = True

    def _settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        self._calm(self._control)
        for at in range(0, len(payload), 6):
            key = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if key == _INITIAL_WINDOW:
                self._initial_window(value)
            elif key == _MAX_FRAME:
                if not MIN_FRAME <= value <= MAX_FRAME:
                    raise ProtocolError(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.sender.max_frame = value
            elif key == _ENABLE_PUSH and value > 1:
                raise ProtocolError(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _initial_window(self, value: int) -> None:
        if value > MAX_WINDOW:
            raise ProtocolError(FLOW_CONTROL_ERROR, "initial window too large")
        change = value - self._peer_window
        for stream in self.streams.values():
            stream.send_window += change
            if stream.send_window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "a stream's window past 2^31-1")
        self._peer_window = value

    def _window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "WINDOW_UPDATE not 4 bytes")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                raise ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.sender.window += increment
            if self.sender.window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "connection window past 2^31-1")
            self._flush_blocked()
            return
        if stream_id > self.last_stream_id or not stream_id % 2:
            raise ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # closed: it may come after we ended the stream
        if not increment:
            self.reset_stream(stream_id, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self.reset_stream(stream_id, FLOW_CONTROL_ERROR)
            return
        self._flush(stream)

    def _ping(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ProtocolError(FRAME_SIZE_ERROR, "PING not 8 bytes")
        if flags & ACK:
            if bytes(payload) == _KEEPALIVE_PING and self._timers[1] is not None:
                self._timers[1].cancel()
                self._timers[1] = None
            return
        self._calm(self._control)
        self._ping_policy()
        self._write(frame(PING, ACK, 0, bytes(payload)))

    def _ping_policy(self) -> None:
        """gRPC core's: a client PING sooner than allowed after the last, with no data
        sent between, is a strike; past ``max_ping_strikes`` the connection is closed."""
        limits = self.limits
        if self.sender.sent != self._strike_seen:  # we sent data since: strikes forgiven
            self._strike_seen = self.sender.sent
            self._strikes = 0
            self._last_ping = float("-inf")
        now = time.monotonic()
        if self.streams or limits.keepalive_permit_without_calls:
            interval = limits.min_recv_ping_interval_without_data_ms / 1000
        else:
            interval = _IDLE_CLIENT_PING_S
        if now < self._last_ping + interval:
            self._strikes += 1
            if limits.max_ping_strikes and self._strikes > limits.max_ping_strikes:
                raise ProtocolError(ENHANCE_YOUR_CALM, "too_many_pings")
        self._last_ping = now

    # -- timers ---------------------------------------------------------------------------
    def _keepalive(self) -> None:
        """Every ``keepalive_time_ms``: a PING, unless the connection has no calls (and
        they are not permitted) or enough PINGs went with no data between."""
        limits = self.limits
        if self._dead:
            return
        if self.sender.sent != self._data_seen:
            self._data_seen = self.sender.sent
            self._pings_unanswered = 0
        allowed = limits.max_pings_without_data
        if (self.streams or limits.keepalive_permit_without_calls) and (
            not allowed or self._pings_unanswered < allowed
        ):
            self._pings_unanswered += 1
            self._write(frame(PING, 0, 0, _KEEPALIVE_PING))
            if self._timers[1] is None:
                self._timers[1] = self._later(limits.keepalive_timeout_ms, self._keepalive_lost)
        self._timers[0] = self._later(limits.keepalive_time_ms, self._keepalive)

    def _keepalive_lost(self) -> None:
        log.debug("HTTP/2 keepalive PING not answered in time: closing the connection")
        self._timers[1] = None
        self._go_away(NO_ERROR, "keepalive watchdog timeout")

    def _idle_check(self) -> None:
        """Every ``max_connection_idle_ms``: a connection that had no stream open since
        the last look gets GOAWAY NO_ERROR and is closed."""
        if self._dead:
            return
        if not self.streams and self.last_stream_id == self._idle_seen:
            self._go_away(NO_ERROR, "max_idle")
            return
        self._idle_seen = self.last_stream_id if not self.streams else -1
        self._timers[2] = self._later(self.limits.max_connection_idle_ms, self._idle_check)

    # -- ending the connection ------------------------------------------------------------
    def go_away(self) -> None:
        """Tell the client to open no more streams; the open ones go on."""
        if not self.going_away:
            self.going_away = True
            self._write(frame(GOAWAY, 0, 0, self.last_stream_id.to_bytes(4, "big") + bytes(4)))

    def _go_away(self, code: int, reason: str) -> None:
        """A connection error (or the end of an idle one): GOAWAY with ``code``, closed."""
        if self._dead:
            return
        payload = self.last_stream_id.to_bytes(4, "big") + _code(code)
        self._write(frame(GOAWAY, 0, 0, payload + reason.encode()[:256]))
        self.abort()

    def abort(self) -> None:
        self._dead = True
        self._backlog = None
        self.sender.uncork()  # a GOAWAY written while frames were read goes out first
        if self.transport is not None:
            self.transport.close()
