"""The HTTP/2 connection as a state machine, without a socket: bytes in through
``data_received``, frames out through its output (a recorder), its stream callbacks
recorded by a subclass that answers them as the gRPC connection does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from h2_wire import Frame, Wire, data, headers, opening, request_head, still_budgets

from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.connection import Connection
from dlserve.server.transport.h2.frames import (
    ACK,
    CANCEL,
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
    HIGH_WATER,
    MAX_FRAME,
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
    frame,
)
from dlserve.server.transport.h2.limits import Limits

Event = tuple[Any, ...]


class Recorder(Connection):
    """Records the callbacks; ``hold``: streams whose received bytes are not taken yet."""

    def __init__(self, limits: Limits = Limits()) -> None:  # noqa: B008 (frozen)
        super().__init__(limits)
        self.events: list[Event] = []
        self.hold: set[int] = set()
        self.runs = 0  # runs of DATA frames handed on together

    def stream_frames(self, stream_id: int, frames: memoryview, length: int) -> int:
        self.runs += 1
        return super().stream_frames(stream_id, frames, length)

    def stream_opened(self, stream_id: int, headers: hpack_codec.Headers, end: bool) -> None:
        self.events.append(("opened", stream_id, dict(headers), end))

    def stream_data(self, stream_id: int, data: memoryview | bytes, end_stream: bool) -> None:
        self.events.append(("data", stream_id, bytes(data), end_stream))

    def stream_reset(self, stream_id: int) -> None:
        self.events.append(("reset", stream_id))

    def closed(self) -> None:
        self.events.append(("closed",))

    def holding(self, stream_id: int) -> bool:
        return stream_id in self.hold


BIG_FRAMES = Limits(max_frame_size=MAX_FRAME)  # a server that takes frames of any size


def connected(window: int = MAX_WINDOW, limits: Limits = Limits()) -> tuple[Recorder, Wire]:  # noqa: B008
    """A connection past the client's preface and SETTINGS, its first frames taken."""
    connection, wire = Recorder(limits), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    connection.data_received(opening(window))
    wire.take()
    return connection, wire


def _code(goaway: Frame) -> int:
    return int.from_bytes(goaway.payload[4:8], "big")


def _dialogue() -> bytes:
    """Two requests, one in several DATA frames, one padded, one header block continued."""
    block = request_head(b"/t.S/Two")
    return b"".join((
        opening(),
        headers(1, request_head()), data(1, b"ab"), data(1, b"cd", end_stream=True),
        frame(HEADERS, 0, 3, block[:5]), frame(CONTINUATION, END_HEADERS, 3, block[5:]),
        frame(DATA, PADDED | END_STREAM, 3, bytes([3]) + b"xyz" + bytes(3)),
    ))  # fmt: skip


# -- the start ------------------------------------------------------------------------------
def test_the_server_speaks_first_with_its_settings_and_window() -> None:
    connection, wire = Recorder(), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    settings, window = wire.take()
    assert (settings.kind, settings.flags) == (SETTINGS, 0)
    limits = Limits()
    assert settings.payload == (  # the initial window, concurrent streams, header list size
        b"\x00\x04" + STREAM_WINDOW.to_bytes(4, "big")
        + b"\x00\x03" + limits.max_concurrent_streams.to_bytes(4, "big")
        + b"\x00\x06" + limits.max_header_list_size.to_bytes(4, "big")
    )  # fmt: skip
    assert (window.kind, window.stream) == (WINDOW_UPDATE, 0)
    assert int.from_bytes(window.payload, "big") == CONNECTION_WINDOW - 65535


def test_a_client_without_the_preface_is_closed() -> None:
    connection, wire = Recorder(), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    wire.take()
    connection.data_received(b"GET / HTTP/1.1\r\n\r\n")
    [goaway] = wire.take()
    assert wire.closed and not connection.events
    assert goaway.kind == GOAWAY and _code(goaway) == PROTOCOL_ERROR


def test_settings_are_acknowledged() -> None:
    connection, wire = Recorder(), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    wire.take()
    connection.data_received(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
    assert wire.take() == [Frame(SETTINGS, ACK, 0, b"")]  # theirs acked; our ack ignored


# -- frames in ------------------------------------------------------------------------------
def test_streams_arrive_as_callbacks() -> None:
    connection = Recorder()
    connection.connection_made(Wire())  # type: ignore[arg-type]
    connection.data_received(_dialogue())
    first, second = request_head(), request_head(b"/t.S/Two")
    assert connection.events == [
        ("opened", 1, dict(hpack_codec.Decoder().decode(first)), False),
        ("data", 1, b"ab", False),
        ("data", 1, b"cd", True),
        ("opened", 3, dict(hpack_codec.Decoder().decode(second)), False),
        ("data", 3, b"xyz", True),  # padding stripped
    ]


@pytest.mark.parametrize("cut", [1, 7, 9, 10, 100])
def test_bytes_cut_anywhere_make_the_same_callbacks(cut: int) -> None:
    """Frames split across reads (even the preface, even a 9-byte frame head) are joined."""
    whole, pieces = Recorder(), Recorder()
    whole.connection_made(Wire())  # type: ignore[arg-type]
    pieces.connection_made(Wire())  # type: ignore[arg-type]
    dialogue = _dialogue()
    whole.data_received(dialogue)
    for at in range(0, len(dialogue), cut):
        pieces.data_received(dialogue[at : at + cut])
    assert pieces.events == whole.events


def test_a_large_data_frame_is_handed_on_as_it_arrives() -> None:
    """A DATA frame of 256 KiB or more reaches the stream piece by piece, each piece a view
    of the bytes that arrived (not joined first), the end of the stream with the last."""
    connection, _ = connected(limits=BIG_FRAMES)
    connection.data_received(headers(1, request_head()))
    payload = bytes(range(256)) * 1200  # 300 KiB
    big = frame(DATA, END_STREAM, 1, payload)
    for at in range(0, len(big), 100_000):
        connection.data_received(big[at : at + 100_000])
    pieces = connection.events[1:]
    assert len(pieces) == 4
    assert b"".join(piece[2] for piece in pieces) == payload
    assert [piece[3] for piece in pieces] == [False, False, False, True]


def test_headers_with_priority_and_padding() -> None:
    connection, _ = connected()
    block = request_head()
    payload = bytes([2]) + bytes(5) + block + bytes(2)  # pad length, priority, block, padding
    connection.data_received(frame(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1, payload))
    assert connection.events == [("opened", 1, dict(hpack_codec.Decoder().decode(block)), False)]


def test_trailers_from_the_client_end_its_stream() -> None:
    connection, _ = connected()
    trailers = hpack_codec.encode([(b"x-checksum", b"1")])
    connection.data_received(headers(1, request_head()) + headers(1, trailers, end_stream=True))
    assert connection.events[1:] == [("data", 1, b"", True)]


def test_ping_is_answered_at_once() -> None:
    connection, wire = connected()
    connection.data_received(frame(PING, 0, 0, b"12345678") + frame(PING, ACK, 0, b"87654321"))
    assert wire.take() == [Frame(PING, ACK, 0, b"12345678")]


def test_the_answers_to_the_frames_of_one_read_go_out_in_one_write() -> None:
    connection, wire = connected()
    connection.data_received(frame(PING, 0, 0, b"12345678") + frame(SETTINGS, 0, 0) * 10)
    ack = Frame(SETTINGS, ACK, 0, b"")
    assert wire.batches[-1:] == [[Frame(PING, ACK, 0, b"12345678"), *[ack] * 10]]


def test_a_connection_error_goes_out_after_the_answers_before_it_and_before_the_close() -> None:
    connection, wire = connected()
    connection.data_received(frame(PING, 0, 0, b"12345678") + frame(PING, 0, 0, b"short"))
    (batch,) = wire.batches[-1:]
    assert batch[0] == Frame(PING, ACK, 0, b"12345678")
    assert (batch[1].kind, _code(batch[1])) == (GOAWAY, FRAME_SIZE_ERROR)
    assert wire.closed  # the Wire refuses a write after its close: none came


def test_a_reset_stream_is_gone() -> None:
    connection, _ = connected()
    connection.data_received(headers(1, request_head()))
    connection.data_received(frame(RST_STREAM, 0, 1, bytes(4)) + data(1, b"late"))
    assert connection.events[1:] == [("reset", 1)]  # its late data is dropped
    assert 1 not in connection.streams


@pytest.mark.parametrize(
    ("bytes_in", "code"),
    [
        (headers(2, request_head()), PROTOCOL_ERROR),  # a client's stream is odd
        (frame(CONTINUATION, END_HEADERS, 1, b""), PROTOCOL_ERROR),  # without HEADERS
        (frame(HEADERS, 0, 1, b"") + data(1, b""), PROTOCOL_ERROR),  # not a CONTINUATION
        (frame(PUSH_PROMISE, 0, 1, bytes(4)), PROTOCOL_ERROR),
        (frame(PING, 0, 0, b"short"), FRAME_SIZE_ERROR),
        (frame(SETTINGS, 0, 0, b"\x00\x04\x00"), FRAME_SIZE_ERROR),
        (frame(WINDOW_UPDATE, 0, 0, b"\x00"), FRAME_SIZE_ERROR),
        (headers(1, b"\xff\xff\xff\xff\x7f"), COMPRESSION_ERROR),  # an index out of range
    ],
    ids=["even", "continuation", "interrupted", "push", "ping", "settings", "window", "hpack"],
)  # fmt: skip
def test_a_protocol_error_ends_the_connection_with_goaway(bytes_in: bytes, code: int) -> None:
    connection, wire = connected()
    connection.data_received(bytes_in)
    [goaway] = wire.take()
    assert goaway.kind == GOAWAY and _code(goaway) == code
    assert wire.closed


def test_after_goaway_new_streams_are_refused_and_open_ones_go_on() -> None:
    connection, wire = connected()
    connection.data_received(headers(1, request_head()))
    connection.go_away()
    [goaway] = wire.take()
    assert goaway.kind == GOAWAY and goaway.payload[:4] == (1).to_bytes(4, "big")
    connection.data_received(headers(3, request_head()) + data(1, b"more", end_stream=True))
    assert wire.take() == [Frame(RST_STREAM, 0, 3, REFUSED_STREAM.to_bytes(4, "big"))]
    assert connection.events[1:] == [("data", 1, b"more", True)]


def test_the_lost_connection_tells_the_subclass_and_writes_no_more() -> None:
    connection, wire = connected()
    connection.data_received(headers(1, request_head()))
    connection.connection_lost(None)
    assert connection.events[-1] == ("closed",)
    assert not connection.streams
    connection.send(1, b"", [b"x"], b"")  # nothing to write to: dropped
    assert not wire.take()


# -- flow control, receiving ------------------------------------------------------------------
def _received(connection: Recorder, wire: Wire, size: int) -> list[Frame]:
    connection.data_received(data(1, bytes(size)))
    return [f for f in wire.take() if f.kind == WINDOW_UPDATE]


def test_a_streams_window_is_given_back_once_half_of_it_has_come() -> None:
    connection, wire = connected(limits=BIG_FRAMES)
    connection.data_received(headers(1, request_head()))
    half = STREAM_WINDOW // 2
    assert _received(connection, wire, half - 1) == []
    [update] = _received(connection, wire, 1)
    assert update.stream == 1 and int.from_bytes(update.payload, "big") == half


def test_a_held_stream_gets_its_window_when_its_reader_takes_it() -> None:
    connection, wire = connected(limits=BIG_FRAMES)
    connection.data_received(headers(1, request_head()))
    connection.hold.add(1)
    half = STREAM_WINDOW // 2
    assert _received(connection, wire, half) + _received(connection, wire, half) == []
    connection.hold.clear()
    connection.give_back(1)
    [update] = wire.take()
    assert (update.kind, update.stream) == (WINDOW_UPDATE, 1)
    assert int.from_bytes(update.payload, "big") == STREAM_WINDOW


# -- runs of DATA frames ------------------------------------------------------------------------
FULL = 16384  # the default SETTINGS_MAX_FRAME_SIZE


def frames_of(data_: bytes) -> list[bytes]:
    """The frames of ``data_``, each whole."""
    out, at = [], 0
    while at < len(data_):
        end = at + 9 + int.from_bytes(data_[at : at + 3], "big")
        out.append(data_[at:end])
        at = end
    return out


def run_both(
    before: bytes,
    *reads: bytes,
    limits: Limits = Limits(),  # noqa: B008 (frozen)
    reset: int = 0,
    hold: int = 0,
) -> tuple[Recorder, Wire, Recorder, Wire]:
    """``reads`` after ``before`` to two connections: as they are (DATA frames just like the
    one before them make runs) and one frame per read (no run); ``reset``: a stream the
    server resets after ``before``; ``hold``: one whose reader takes nothing."""
    made = []
    for one_by_one in (False, True):
        connection, wire = connected(limits=limits)
        connection.hold.add(hold)
        connection.data_received(before)
        if reset:
            connection.reset_stream(reset, CANCEL)
        for read in reads:
            for piece in frames_of(read) if one_by_one else [read]:
                connection.data_received(piece)
        made += [connection, wire]
    return made[0], made[1], made[2], made[3]


def assert_the_same(whole: Recorder, wire: Wire, framed: Recorder, framed_wire: Wire) -> None:
    assert whole.events == framed.events
    assert wire.frames == framed_wire.frames and wire.closed == framed_wire.closed
    assert (whole._recv_unacked, whole._recv_credit) == (framed._recv_unacked, framed._recv_credit)
    assert whole._in_flight == framed._in_flight and whole._dropped == framed._dropped
    assert framed.runs == 0
    assert {i: s.recv_pending for i, s in whole.streams.items()} == {
        i: s.recv_pending for i, s in framed.streams.items()
    }


def test_a_run_of_data_frames_is_handed_on_as_its_frames_are() -> None:
    """Frames just like the one before them (one stream, one length, no flag) are counted
    and handed on together; the stream sees each frame's payload, the client the same
    window updates, as when each frame comes in a read of its own."""
    payloads = [bytes([n]) * FULL for n in range(40)] + [b"x" * 100] * 3
    reads = b"".join(data(1, p) for p in payloads) + data(1, b"end", end_stream=True)
    whole, wire, framed, framed_wire = run_both(headers(1, request_head()), reads)
    assert_the_same(whole, wire, framed, framed_wire)
    assert [e[2] for e in whole.events[1:]] == [*payloads, b"end"]
    assert whole.runs == 4  # 16, 16 and 8 frames of 16 KiB, 3 of 100 bytes


def test_a_run_past_the_streams_window_errs_at_its_frame() -> None:
    """The frame that takes the stream past its window is FLOW_CONTROL_ERROR, the frames
    before it handed on, as frame by frame."""
    frames = data(1, b"\x01" * FULL) * (STREAM_WINDOW // FULL + 3)
    whole, wire, framed, framed_wire = run_both(headers(1, request_head()), frames, hold=1)
    assert_the_same(whole, wire, framed, framed_wire)
    assert wire.closed and _code(wire.of(0)[-1]) == FLOW_CONTROL_ERROR
    assert len(whole.events) == 1 + STREAM_WINDOW // FULL


def test_a_run_past_the_streams_content_length_is_reset_at_its_frame() -> None:
    head = request_head(b"/t.S/Echo", (b"content-length", b"%d" % (10 * 1000)))
    frames = data(1, b"y" * 1000) * 12
    whole, wire, framed, framed_wire = run_both(headers(1, head), frames)
    assert_the_same(whole, wire, framed, framed_wire)
    assert [f.kind for f in wire.of(1)] == [RST_STREAM]
    assert [e[0] for e in whole.events] == ["opened", *["data"] * 10, "reset"]


@pytest.mark.parametrize("received", [0, STREAM_WINDOW - 40 * FULL])
def test_a_run_on_a_stream_the_server_ended_is_dropped_as_its_frames_are(
    received: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DATA the client had on its way when the server reset its stream is dropped, free
    within the window the client had; past it each frame spends the control budget, and a
    run of them ends in ENHANCE_YOUR_CALM after as many frames as one by one."""
    still_budgets(monkeypatch)
    limits = Limits(max_frame_size=MAX_FRAME, max_control_frames_per_s=100)  # 20 at once
    before = headers(1, request_head()) + (data(1, bytes(received)) if received else b"")
    frames = data(1, b"z" * FULL) * 80
    whole, wire, framed, framed_wire = run_both(before, frames, limits=limits, reset=1, hold=1)
    assert_the_same(whole, wire, framed, framed_wire)
    assert wire.closed == bool(received)
    if received:
        assert _code(wire.of(0)[-1]) == ENHANCE_YOUR_CALM


# -- flow control, sending --------------------------------------------------------------------
def test_a_response_within_the_windows_leaves_in_one_write() -> None:
    connection, wire = connected()
    connection.data_received(headers(1, request_head()))
    head = frame(HEADERS, END_HEADERS, 1, b"\x88")
    connection.send(1, head, [b"abc", memoryview(b"def")], b"\x88")
    [batch] = wire.batches[-1:]
    assert [(f.kind, f.stream, f.payload) for f in batch] == [
        (HEADERS, 1, b"\x88"), (DATA, 1, b"abcdef"), (HEADERS, 1, b"\x88"),
    ]  # fmt: skip
    assert batch[-1].flags & END_STREAM and 1 not in connection.streams


def test_data_waits_for_the_clients_window_and_its_frame_size() -> None:
    """The client's initial window is 65535 bytes: the rest waits in the stream's queue, in
    frames no larger than 16 KiB, and the trailers go after the last of it."""
    connection, wire = connected(window=65535)
    connection.data_received(headers(1, request_head()))
    body = bytes(range(256)) * 400  # 100 KiB
    connection.send(1, b"", [body], b"\x88")
    sent = wire.take()
    assert all(f.kind == DATA and len(f.payload) <= 16384 for f in sent)
    assert sum(len(f.payload) for f in sent) == 65535
    connection.data_received(frame(WINDOW_UPDATE, 0, 1, (2**20).to_bytes(4, "big")))
    rest = wire.take()
    assert b"".join(f.payload for f in sent + rest[:-1]) == body
    assert rest[-1].kind == HEADERS and rest[-1].flags & END_STREAM


def test_a_smaller_initial_window_holds_back_an_open_stream() -> None:
    connection, wire = connected()
    connection.data_received(headers(1, request_head()))
    connection.data_received(frame(SETTINGS, 0, 0, b"\x00\x04" + (10).to_bytes(4, "big")))
    wire.take()
    connection.send(1, b"", [bytes(100)])
    assert [len(f.payload) for f in wire.take()] == [10]  # the rest waits for window


def test_a_producer_waits_while_its_stream_has_more_than_high_water_queued() -> None:
    async def scenario() -> None:
        connection, wire = connected(window=0)
        connection.data_received(headers(1, request_head()))
        connection.send(1, b"", [bytes(HIGH_WATER + 1)])
        waiting = asyncio.ensure_future(connection.drained(1))
        await asyncio.sleep(0)
        assert not waiting.done() and not wire.take()
        connection.data_received(frame(WINDOW_UPDATE, 0, 1, (2**20).to_bytes(4, "big")))
        await asyncio.wait_for(waiting, 5)
        assert sum(len(f.payload) for f in wire.take()) == 2**20

    asyncio.run(scenario())
