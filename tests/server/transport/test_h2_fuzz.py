"""Fuzzing the HTTP/2 frame reader and the HPACK decoder (hypothesis): the connection
driven with bytes, no socket; arbitrary bytes, and frames well-built but wrong (any type,
flags, stream, payload; header blocks of a real request, of garbage, cut across
CONTINUATION). Whatever comes, ``data_received`` never raises, the connection keeps
within its bounds (a partial frame, a header block, streams open, closed streams
remembered, what a stream has received), and it ends either still serving or with a
GOAWAY that carries an error code, closed. DATA frames in one read, handled in runs, do
what the same frames do one read each. The decoder, given any bytes, returns a header
list within its limit or raises one of its two errors.

A bounded number of examples, derandomized, here; ``tools/fuzz.py h2 --examples N`` runs
the same properties longer, with random seeds (``fuzzing.py``)."""

from __future__ import annotations

from typing import Any

from h2_wire import Wire, opening, request_head
from hypothesis import given
from hypothesis import strategies as st

from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.connection import Connection
from dlserve.server.transport.h2.frames import (
    CONNECTION_WINDOW,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    RST_STREAM,
    STREAM_WINDOW,
    frame,
)
from dlserve.server.transport.h2.limits import Limits
from fuzzing import fuzz_settings

FUZZ = fuzz_settings(3000)
LIMITS = Limits(max_concurrent_streams=8, max_header_list_size=4096)
ERROR_CODES = range(0x0, 0xE)


class Sink(Connection):
    """Takes every stream's data and answers nothing: the connection's own behaviour."""

    def __init__(self) -> None:
        super().__init__(LIMITS)
        self.opened = 0

    def stream_opened(self, stream_id: int, headers: Any, end_stream: bool) -> None:
        self.opened += 1

    def stream_data(self, stream_id: int, data: memoryview | bytes, end_stream: bool) -> None:
        pass

    def stream_reset(self, stream_id: int) -> None:
        pass


def _bounded(connection: Sink) -> None:
    """What the connection keeps stays within the bounds that its limits give."""
    assert connection._partial_size <= LIMITS.max_frame_size + 9 or not connection._partial
    assert len(connection._block) <= 2 * LIMITS.max_header_list_size
    assert len(connection.streams) <= LIMITS.max_concurrent_streams
    assert len(connection._closed) <= 256
    assert connection._recv_unacked <= CONNECTION_WINDOW
    assert all(s.recv_pending <= STREAM_WINDOW for s in connection.streams.values())


def _ended_well(wire: Wire) -> None:
    """Still serving, or closed after a GOAWAY with an error code."""
    if wire.closed:
        goaways = [f for f in wire.frames if f.kind == GOAWAY]
        assert goaways, "closed without a GOAWAY"
        assert int.from_bytes(goaways[-1].payload[4:8], "big") in ERROR_CODES


def _drive(pieces: list[bytes]) -> tuple[Sink, Wire]:
    connection, wire = Sink(), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    for piece in pieces:
        if wire.closed:
            break
        connection.data_received(piece)
        _bounded(connection)
    _ended_well(wire)
    return connection, wire


@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=8))
def test_arbitrary_bytes_after_the_opening(pieces: list[bytes]) -> None:
    _drive([opening(), *pieces])


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_from_the_start(data: bytes) -> None:
    _drive([data])


_BLOCKS = st.sampled_from([
    request_head(), request_head(b"/t.S/Two", (b"x-a", b"1")), b"", b"\x82", b"\xff\xff",
    b"\x20", b"\x3f\xe2\x1f", hpack_codec.encode([(b":path", b"/")]), b"\x40\x01x\x01y",
])  # fmt: skip
_PAYLOADS = st.one_of(
    st.binary(max_size=40), _BLOCKS,
    st.builds(lambda n: n.to_bytes(4, "big"), st.integers(0, 2**32 - 1)),
    st.builds(lambda k, v: k.to_bytes(2, "big") + v.to_bytes(4, "big"),
              st.integers(0, 8), st.integers(0, 2**32 - 1)),
)  # fmt: skip
_FRAMES = st.builds(
    frame, st.integers(0, 12), st.integers(0, 255), st.sampled_from([0, 1, 2, 3, 5, 7, 2**31 - 1]),
    _PAYLOADS,
)  # fmt: skip


@FUZZ
@given(st.lists(_FRAMES, max_size=30), st.integers(1, 64))
def test_frames_well_built_but_wrong(frames: list[bytes], cut: int) -> None:
    """Any sequence of frames, the bytes cut into reads of ``cut`` bytes."""
    data = b"".join(frames)
    _drive([opening(), *(data[at : at + cut] for at in range(0, len(data), cut))])


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([1, 3, 5]), st.binary(max_size=3000)), max_size=6))
def test_header_blocks_cut_across_continuations(blocks: list[tuple[int, bytes]]) -> None:
    frames = []
    for stream, block in blocks:
        pieces = [block[at : at + 1000] for at in range(0, len(block), 1000)] or [b""]
        last = len(pieces) - 1
        frames.append(frame(HEADERS, END_HEADERS if not last else 0, stream, pieces[0]))
        frames += [
            frame(CONTINUATION, END_HEADERS if i == last else 0, stream, piece)
            for i, piece in enumerate(pieces[1:], 1)
        ]
    _drive([opening(), *frames])


class Taker(Sink):
    """A sink that records what each stream is handed, and ends a stream after 40 KiB (a
    reader that answers before the rest of a request has come)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: list[tuple[int, bytes, bool]] = []
        self.sizes: dict[int, int] = {}

    def stream_data(self, stream_id: int, data: memoryview | bytes, end_stream: bool) -> None:
        self.taken.append((stream_id, bytes(data), end_stream))
        self.sizes[stream_id] = self.sizes.get(stream_id, 0) + len(data)
        if self.sizes[stream_id] > 40_000 and stream_id in self.streams:
            self.reset_stream(stream_id, 0)


_OPENED = st.lists(st.tuples(st.sampled_from([1, 3, 5]), st.sampled_from([None, 0, 5000])),
                   max_size=3)  # fmt: skip
_RUNS = st.lists(
    st.tuples(st.sampled_from([0, 1, 3, 5, 9]), st.sampled_from([0, 1, 100, 1024, 16384]),
              st.integers(1, 24), st.sampled_from([0, 0, 0, END_STREAM, PADDED]),
              st.sampled_from([b"", frame(RST_STREAM, 0, 3, bytes(4))])),
    max_size=10,
)  # fmt: skip


@FUZZ
@given(_OPENED, _RUNS)
def test_runs_of_data_frames_change_nothing(
    opened: list[tuple[int, int | None]], runs: list[tuple[int, int, int, int, bytes]]
) -> None:
    """DATA frames just like the one before them are handled as one run: what the streams
    are handed, what the client is sent and what the connection counts are the same as
    when each frame comes in a read of its own (no run)."""
    frames = []
    for stream, length in opened:
        extra = ((b"content-length", b"%d" % length),) if length is not None else ()
        frames.append(frame(HEADERS, END_HEADERS, stream, request_head(b"/t.S/A", *extra)))
    for stream, length, repeat, flags, after in runs:
        payload = bytes([length % 7]) + bytes(length - 1) if length else b""
        frames += [frame(DATA, flags, stream, payload)] * repeat + [after]
    done = []
    for pieces in (frames, [b"".join(frames)]):
        connection, wire = Taker(), Wire()
        connection.connection_made(wire)  # type: ignore[arg-type]
        for piece in [opening(), *pieces]:
            if not wire.closed:
                connection.data_received(piece)
        done.append((
            connection.taken, wire.frames, wire.closed, connection._recv_unacked,
            connection._recv_credit, connection._in_flight, connection._dropped,
        ))  # fmt: skip
    assert done[0] == done[1]


@FUZZ
@given(st.binary(max_size=2000))
def test_the_decoder_returns_a_bounded_list_or_its_error(block: bytes) -> None:
    decoder = hpack_codec.Decoder(4096, 1024)
    for _ in range(2):  # twice: the second time, with its table as the first left it
        try:
            fields = decoder.decode(block)
        except (hpack_codec.HpackError, hpack_codec.HeaderListTooLarge):
            continue
        assert sum(len(n) + len(v) + 32 for n, v in fields) <= 1024
        assert decoder._size <= 4096
