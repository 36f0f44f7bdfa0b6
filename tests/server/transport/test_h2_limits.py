"""What one HTTP/2 connection allows its client (``h2/limits.py``), without a socket:
windows enforced, concurrent streams, the budgets against floods of cheap frames (rapid
reset, SETTINGS, PING, empty CONTINUATION), the work one connection does before the
loop gets its turn (bytes read, time spent), keepalive PINGs, PING strikes and the idle timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from h2_wire import Frame, Wire, data, headers, opening, request_head, still_budgets
from test_h2_connection import Recorder

from dlserve.server.transport.h2.frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    END_HEADERS,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PING,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_WINDOW,
    WINDOW_UPDATE,
    frame,
)
from dlserve.server.transport.h2.hpack_codec import Headers
from dlserve.server.transport.h2.limits import Budget, Limits
from dlserve.server.transport.turns import TURN_S


def _connected(limits: Limits = Limits()) -> tuple[Recorder, Wire]:  # noqa: B008
    connection, wire = Recorder(limits), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    connection.data_received(opening())
    wire.take()
    return connection, wire


def _goaway(wire: Wire) -> tuple[int, bytes]:
    [goaway] = [f for f in wire.frames if f.kind == GOAWAY]
    assert wire.closed
    return int.from_bytes(goaway.payload[4:8], "big"), goaway.payload[8:]


def test_data_past_a_held_streams_window_ends_the_connection_and_is_not_kept() -> None:
    connection, wire = _connected()
    connection.data_received(headers(1, request_head()))
    connection.hold.add(1)
    piece = data(1, bytes(16384))
    connection.data_received(piece * (STREAM_WINDOW // 16384) + data(1, b"x"))
    assert _goaway(wire)[0] == FLOW_CONTROL_ERROR
    taken = sum(len(e[2]) for e in connection.events if e[0] == "data")
    assert taken == STREAM_WINDOW  # the byte past the window never reached the stream


def test_streams_past_the_limit_are_refused() -> None:
    connection, wire = _connected(Limits(max_concurrent_streams=2))
    connection.data_received(b"".join(headers(s, request_head()) for s in (1, 3, 5)))
    assert [e[1] for e in connection.events] == [1, 3]
    assert wire.frames == [Frame(RST_STREAM, 0, 5, REFUSED_STREAM.to_bytes(4, "big"))]


def test_a_header_list_past_its_limit_is_answered_by_the_subclass() -> None:
    connection, wire = _connected(Limits(max_header_list_size=1024))
    connection.data_received(headers(1, request_head(b"/t.S/Echo", (b"x-big", b"v" * 1000))))
    assert connection.events == [("reset", 1)]  # never opened for the subclass
    assert wire.frames == [Frame(RST_STREAM, 0, 1, REFUSED_STREAM.to_bytes(4, "big"))]


def _flood(unit: Callable[[int], bytes], count: int, limits: Limits = Limits()) -> Wire:  # noqa: B008
    connection, wire = _connected(limits)
    connection.data_received(b"".join(unit(n) for n in range(count)))
    return wire


def test_a_rapid_reset_flood_gets_enhance_your_calm(monkeypatch: pytest.MonkeyPatch) -> None:
    still_budgets(monkeypatch)
    limits = Limits(max_resets_per_s=200)  # 40 at once: a fifth of a second's worth

    def reset(n: int) -> bytes:
        stream = 1 + 2 * n
        return headers(stream, request_head()) + frame(RST_STREAM, 0, stream, bytes(4))

    assert not _flood(reset, 40, limits).closed  # the budget's worth passes
    assert _goaway(_flood(reset, 50, limits))[0] == ENHANCE_YOUR_CALM


def test_settings_and_ping_floods_get_enhance_your_calm(monkeypatch: pytest.MonkeyPatch) -> None:
    still_budgets(monkeypatch)
    limits = Limits(max_control_frames_per_s=100, max_ping_strikes=0)
    assert _goaway(_flood(lambda n: frame(SETTINGS, 0, 0), 200, limits))[0] == ENHANCE_YOUR_CALM
    ping = frame(PING, 0, 0, bytes(8))
    assert _goaway(_flood(lambda n: ping, 200, limits))[0] == ENHANCE_YOUR_CALM


def test_a_stream_of_empty_continuations_gets_enhance_your_calm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    still_budgets(monkeypatch)
    connection, wire = _connected(Limits(max_control_frames_per_s=100))
    empty = frame(CONTINUATION, 0, 1, b"")
    connection.data_received(frame(HEADERS, 0, 1, request_head()) + empty * 200)
    assert _goaway(wire)[0] == ENHANCE_YOUR_CALM


def test_data_sent_before_the_client_heard_the_stream_end_is_no_flood(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DATA on a stream the server ended (its response sent, or RST_STREAM) before the
    client ended it is dropped; up to the rest of the stream's window it is what the client
    may have sent before the end reached it, and free; past that, and empty, each frame is
    a control frame, and a flood of them gets ENHANCE_YOUR_CALM."""
    still_budgets(monkeypatch)
    limits = Limits(max_control_frames_per_s=100)  # 20 at once
    piece = bytes(16384)
    rest = (STREAM_WINDOW - len(piece)) // len(piece)
    for end in ("response", "reset"):
        connection, wire = _connected(limits)
        connection.data_received(headers(1, request_head()) + data(1, piece))
        if end == "response":
            connection.send(1, frame(HEADERS, END_HEADERS, 1, b"\x88"), (), b"\x88")
        else:
            connection.reset_stream(1, NO_ERROR)
        connection.data_received(data(1, piece) * rest)
        assert not wire.closed, end
        connection.data_received(data(1, b"x") * 30)
        assert _goaway(wire)[0] == ENHANCE_YOUR_CALM, end
        connection, wire = _connected(limits)  # empty DATA: never what was on its way
        connection.data_received(headers(1, request_head()) + data(1, piece))
        connection.reset_stream(1, NO_ERROR)
        connection.data_received(data(1, b"") * 30)
        assert _goaway(wire)[0] == ENHANCE_YOUR_CALM


def test_pings_too_often_without_data_are_strikes_then_too_many_pings() -> None:
    ping = frame(PING, 0, 0, bytes(8))
    connection, wire = _connected()
    connection.data_received(ping * 3)  # the first, then two strikes: allowed
    assert not wire.closed
    connection.data_received(ping)
    assert _goaway(wire) == (ENHANCE_YOUR_CALM, b"too_many_pings")


def test_data_sent_between_pings_forgives_the_strikes() -> None:
    connection, wire = _connected()
    connection.data_received(headers(1, request_head()))
    for _ in range(10):
        connection.data_received(frame(PING, 0, 0, bytes(8)))
        connection.send(1, b"", [b"response"])
    assert not wire.closed


def test_data_that_waited_for_window_forgives_the_strikes_too() -> None:
    """A large response goes out as the client's WINDOW_UPDATEs come; a client that PINGs
    with each (grpcio's bandwidth probes do) sees data between its PINGs."""
    connection, wire = Recorder(), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    connection.data_received(opening(window=16384) + headers(1, request_head()))
    connection.send(1, b"", [bytes(20 * 16384)])  # 16 KiB now, the rest as window comes
    more = frame(WINDOW_UPDATE, 0, 1, (16384).to_bytes(4, "big"))
    for _ in range(10):
        connection.data_received(more + frame(PING, 0, 0, bytes(8)))
    assert not wire.closed
    assert sum(len(f.payload) for f in wire.frames if f.kind == DATA) == 11 * 16384


async def _until(condition: Callable[[], bool], deadline_s: float = 5.0) -> None:
    """Let the loop run until ``condition`` holds (or fail at the deadline)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.001)


def test_a_buffer_of_tiny_frames_is_handled_over_several_turns() -> None:
    """1000 PINGs in one read: a bounded number per turn of the loop, reading paused
    until the rest is done, every one answered in the end."""

    async def scenario() -> None:
        connection, wire = _connected(Limits(max_control_frames_per_s=0, max_ping_strikes=0))
        connection.data_received(frame(PING, 0, 0, bytes(8)) * 1000)
        first = len(wire.take())
        assert 0 < first < 1000 and wire.paused
        await _until(lambda: not wire.paused)
        assert first + len(wire.take()) == 1000

    asyncio.run(scenario())


def test_a_connection_read_at_full_speed_lets_the_loop_turn_every_256_kib() -> None:
    """The loop reads a ready socket up to 32 times before its next turn (libuv): each
    read's frames are handled, but by 256 KiB read (sooner if their handling took its
    turn's time) the connection pauses reading until the loop has turned, so other
    connections wait for at most about 256 KiB's work."""

    async def scenario() -> None:
        connection, wire = _connected()
        connection.data_received(headers(1, request_head()))
        await _turned()
        assert not wire.paused
        piece = data(1, bytes(16384)) * 3  # 48 KiB of DATA in a read: handled as it comes
        reads = 0
        while not wire.paused:
            connection.data_received(piece)
            reads += 1
            assert reads <= 6  # 256 KiB: the loop's turn first
        await _turned()
        assert not wire.paused
        taken = sum(len(e[2]) for e in connection.events if e[0] == "data")
        assert taken == reads * 3 * 16384  # every read handled, nothing left behind

    asyncio.run(scenario())


def test_an_uploads_read_is_handled_behind_what_the_loop_woke_with_it() -> None:
    """A read of 64 KiB or more is an upload's: reading pauses, and its frames are handled
    after the callbacks the same turn of the loop scheduled after it (a worker's reply
    that came in the same poll wakes its request first), then reading resumes."""

    async def scenario() -> None:
        connection, wire = _connected()
        connection.data_received(headers(1, request_head()))
        await _turned()
        order: list[str] = []
        handled = connection.stream_data

        def noted(stream_id: int, payload: memoryview | bytes, end_stream: bool) -> None:
            order.append("frames")
            handled(stream_id, payload, end_stream)

        connection.stream_data = noted  # type: ignore[method-assign]
        connection.data_received(data(1, bytes(16384)) * 8)  # 128 KiB
        asyncio.get_running_loop().call_soon(order.append, "woken")  # the same poll's
        assert wire.paused and not order
        await _until(lambda: not wire.paused)
        assert order[0] == "woken" and order.count("frames") == 8
        assert sum(len(e[2]) for e in connection.events if e[0] == "data") == 8 * 16384

    asyncio.run(scenario())


async def _turned() -> None:
    """One turn of the loop."""
    turned = asyncio.Event()
    asyncio.get_running_loop().call_soon(turned.set)
    await turned.wait()


class _Slow(Recorder):
    """A connection whose every new stream costs its loop ``cost_s`` of work."""

    cost_s = 3 * TURN_S / 5

    def stream_opened(self, stream_id: int, headers: Headers, end: bool) -> None:
        super().stream_opened(stream_id, headers, end)
        until = time.perf_counter() + self.cost_s
        while time.perf_counter() < until:
            pass


def _slow(limits: Limits = Limits(max_resets_per_s=0)) -> tuple[_Slow, Wire]:  # noqa: B008
    connection, wire = _Slow(limits), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    connection.data_received(opening())
    return connection, wire


class _Kept(_Slow):
    """A slow connection that notes which buffer each DATA payload it is handed lies in."""

    def __init__(self, limits: Limits) -> None:
        super().__init__(limits)
        self.buffers: list[object] = []

    def stream_data(self, stream_id: int, data: memoryview | bytes, end_stream: bool) -> None:
        self.buffers.append(data.obj if isinstance(data, memoryview) else data)
        super().stream_data(stream_id, data, end_stream)


@pytest.mark.parametrize("cut", [True, False], ids=["turn-ends-inside-a-read", "at-its-end"])
def test_a_read_that_came_before_reading_paused_follows_the_one_that_waits(cut: bool) -> None:
    """A transport may hand on a read after reading paused, while an upload's read waits
    for its turn. Both are handled in order from the buffers they came in (not joined
    into a new one): a frame cut between them is whole, the read the turn ended inside
    (or after) is taken up at the next turn, and the second read follows it."""

    async def scenario() -> None:
        connection, wire = _Kept(Limits(max_resets_per_s=0)), Wire()
        connection.connection_made(wire)  # type: ignore[arg-type]
        connection.data_received(opening() + headers(1, request_head()))
        await _until(lambda: not wire.paused)
        ping = frame(PING, 0, 0, b"pingpong")
        # an upload's frames, then two calls, each 60% of a turn: the turn is over after them
        first = data(1, bytes(16384)) * 4 + headers(3, request_head()) + headers(5, request_head())
        first += headers(7, request_head()) + ping[:4] if cut else b""
        second = (b"" if cut else headers(7, request_head()) + ping[:4]) + ping[4:]
        second += data(1, b"last")
        connection.data_received(first)
        assert wire.paused
        connection.data_received(second)
        await _until(lambda: len(connection.buffers) == 5 and not wire.paused)
        opened = [e[1] for e in connection.events if e[0] == "opened"]
        assert opened == [1, 3, 5, 7]
        assert connection.events[-1] == ("data", 1, b"last", False)
        assert connection.buffers[:4] == [first] * 4 and connection.buffers[4] is second
        assert [f.payload for f in wire.frames if f.kind == PING] == [b"pingpong"]
        assert not wire.closed

    asyncio.run(scenario())


def test_costly_frames_of_one_read_are_handled_a_turns_time_at_a_time() -> None:
    """Ten requests in one read, each 60% of a turn's time to handle: two at most before
    the loop's turn (the turn is over after the second), reading paused until all are."""

    async def scenario() -> None:
        connection, wire = _slow()
        connection.data_received(b"".join(headers(s, request_head()) for s in range(1, 21, 2)))
        opened = [e for e in connection.events if e[0] == "opened"]
        assert 1 <= len(opened) <= 2 and wire.paused
        await _until(lambda: not wire.paused)
        assert len([e for e in connection.events if e[0] == "opened"]) == 10

    asyncio.run(scenario())


def test_a_connection_gets_one_turn_per_turn_of_the_loop() -> None:
    """Three requests in one read, each 60% of a turn's time: two in the read's turn, the
    third in the loop's next; reading resumes only at the turn after that, so the loop
    polls the other connections between the two turns that read this one."""

    async def scenario() -> None:
        connection, wire = _slow()
        await _turned()
        connection.data_received(b"".join(headers(s, request_head()) for s in (1, 3, 5)))
        after_the_rest: list[tuple[int, bool]] = []  # the loop's next turn, seen at its end
        asyncio.get_running_loop().call_soon(
            lambda: after_the_rest.append((len(connection.events), wire.paused))
        )
        await _until(lambda: not wire.paused)
        assert after_the_rest == [(3, True)]  # all three handled, reading not yet resumed

    asyncio.run(scenario())


def test_a_turns_time_is_counted_across_reads() -> None:
    """Reads that each cost 60% of a turn, as the loop makes them one after another in
    one of its turns: reading pauses after the second, and resumes after the loop's turn."""

    async def scenario() -> None:
        connection, wire = _slow()
        await _turned()  # the preface's time is behind
        connection.data_received(headers(1, request_head()))
        connection.data_received(headers(3, request_head()))
        assert wire.paused
        await _turned()
        assert not wire.paused

    asyncio.run(scenario())


def test_a_budget_is_spending_past_half_of_its_burst_until_it_fills_again() -> None:
    budget = Budget(5)  # 20 at once (the least burst), 5 a second
    for _ in range(10):
        assert budget.spend()
    assert not budget.spending()  # half left
    assert budget.spend()
    assert budget.spending()
    budget.stamp -= 1.0  # a second later: 5 more
    assert not budget.spending()
    assert not Budget(0).spending()  # no limit, never spending


def test_a_connection_spending_its_reset_budget_waits_for_its_turns() -> None:
    """Fifteen streams opened and reset in one read, each new stream 60% of a turn's
    work: two a turn, at once while the reset budget (20) is more than half full, then a
    turn every ``_SPENDING_WAIT_S``. Ten turns of the loop see some still waiting; they
    all come in the end, and the connection stays up (the budget is not spent)."""

    async def scenario() -> None:
        connection, wire = _slow(Limits(max_resets_per_s=20))
        reset = (8).to_bytes(4, "big")
        connection.data_received(b"".join(
            headers(s, request_head()) + frame(RST_STREAM, 0, s, reset) for s in range(1, 31, 2)
        ))  # fmt: skip
        for _ in range(10):
            await _turned()
        assert len([e for e in connection.events if e[0] == "reset"]) < 15
        await _until(lambda: len([e for e in connection.events if e[0] == "reset"]) == 15)
        assert not wire.closed

    asyncio.run(scenario())


@pytest.mark.parametrize("frames", [3, 8], ids=["reads-as-they-come", "an-uploads-reads"])
def test_a_connection_whose_reads_are_dropped_waits_for_its_turns(frames: int) -> None:
    """DATA still coming for a stream the server reset is dropped (RFC 9113 5.1): once a
    turn's reads were mostly such bytes, the connection's next turn comes
    ``_SPENDING_WAIT_S`` later, not at the loop's next turn; the same bytes for an open
    stream get the next turn. Reads handled as they come, and an upload's (handled a turn
    later), alike."""

    async def scenario(reset: bool) -> bool:
        connection, wire = _connected()
        connection.data_received(headers(1, request_head()))
        if reset:
            connection.reset_stream(1, CANCEL)
        await _turned()
        piece = data(1, bytes(16384)) * frames
        while not wire.paused:
            connection.data_received(piece)
        while connection._backlog is not None:  # the reads' frames handled
            await asyncio.sleep(0)
        await _turned()
        waited = wire.paused
        await _until(lambda: not wire.paused)
        assert not wire.closed
        return waited

    assert asyncio.run(scenario(reset=True))
    assert not asyncio.run(scenario(reset=False))


def test_keepalive_pings_and_closes_a_connection_that_does_not_answer() -> None:
    async def scenario() -> None:
        limits = Limits(keepalive_time_ms=10, keepalive_timeout_ms=50)
        answering, wire = _connected(limits)
        answering.data_received(headers(1, request_head()))
        silent, silent_wire = _connected(limits)
        silent.data_received(headers(1, request_head()))
        await _until(lambda: any(f.kind == PING for f in wire.frames))
        ping = next(f for f in wire.frames if f.kind == PING)
        answering.data_received(frame(PING, ACK, 0, ping.payload))
        await _until(lambda: silent_wire.closed)
        assert _goaway(silent_wire)[0] == NO_ERROR
        assert not wire.closed

    asyncio.run(scenario())


def test_an_idle_connection_is_closed_and_a_busy_one_is_not() -> None:
    async def scenario() -> None:
        limits = Limits(max_connection_idle_ms=20)
        _, idle_wire = _connected(limits)
        busy, busy_wire = _connected(limits)
        busy.data_received(headers(1, request_head()))
        await _until(lambda: idle_wire.closed)
        assert _goaway(idle_wire) == (NO_ERROR, b"max_idle")
        assert not busy_wire.closed

    asyncio.run(scenario())
