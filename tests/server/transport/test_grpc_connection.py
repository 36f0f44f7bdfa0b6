"""gRPC calls on one connection, without a socket: a client's frames go in through
``data_received``, the server's come out through a recorder (``h2_wire.Wire``), and the
server's own parts (handlers, the status of a failure, a guard on headers, tracing) are
what a test gives it. The server is never started: nothing listens."""

from __future__ import annotations

import asyncio
import base64
import gzip
import zlib
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, Final
from urllib.parse import unquote

import grpc
import pytest
from h2_wire import Frame, Wire, data, fields, headers, message, opening, request_head

from dlserve.server.transport.grpc.calls import (
    Context,
    Method,
    Refused,
    parse_timeout,
    trailers,
)
from dlserve.server.transport.grpc.inflate import inflate
from dlserve.server.transport.grpc.limits import GrpcLimits
from dlserve.server.transport.grpc.listener import GrpcServer
from dlserve.server.transport.grpc.outbox import Outbox
from dlserve.server.transport.grpc.rpc import GrpcConnection
from dlserve.server.transport.grpc.status import RpcError, Status
from dlserve.server.transport.h2.frames import (
    DATA,
    END_STREAM,
    GOAWAY,
    HEADERS,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)

NOT_FOUND, INTERNAL = grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.INTERNAL.value[0]
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(30):
            await scenario()

    asyncio.run(bounded())


class Held:
    """A handler that waits until released; what became of it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, request: memoryview, context: Context) -> bytes:
        self.entered.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b"done"


async def echo(request: memoryview, context: Context) -> bytes:
    return bytes(request)


async def chat(requests: AsyncIterator[memoryview], context: Context) -> AsyncIterator[bytes]:
    async for request in requests:
        yield bytes(request) * 2


def connect(methods: Mapping[str, Method], **options: Any) -> tuple[GrpcConnection, Wire]:
    """A connection of a server that was never started, past the client's preface."""
    server = GrpcServer(methods, "127.0.0.1", 0, **options)
    connection, wire = GrpcConnection(server), Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    connection.data_received(opening())
    wire.take()
    return connection, wire


FRAME: Final = 16384  # the largest frame the server allows by default


def call(connection: GrpcConnection, stream: int, *messages: bytes, **head: bytes) -> None:
    """A call: its headers (``head``: extra ones; path=... replaces the path), its messages
    (in frames of the default maximum size), the end of its side."""
    path = head.pop("path", b"/t.S/Echo")
    extra = [(name.replace("_", "-").encode(), value) for name, value in head.items()]
    body = b"".join(messages)
    pieces = [body[at : at + FRAME] for at in range(0, len(body), FRAME)] or [b""]
    connection.data_received(
        headers(stream, request_head(path, *extra))
        + b"".join(data(stream, piece) for piece in pieces[:-1])
        + data(stream, pieces[-1], end_stream=True)
    )


async def ended(wire: Wire, stream: int) -> list[Frame]:
    """The stream's frames, once the server has ended it (yielding to the loop until then;
    the scenario's deadline bounds it)."""
    while not any(f.kind == HEADERS and f.flags & END_STREAM for f in wire.of(stream)):
        await asyncio.sleep(0)
    return wire.of(stream)


def status(frames: list[Frame]) -> tuple[int, str]:
    """The status the stream ended with (its message percent-decoded, as a client does)."""
    last = fields([f for f in frames if f.kind == HEADERS][-1].payload)
    return int(last["grpc-status"]), unquote(last.get("grpc-message", ""))


def messages_of(frames: list[Frame]) -> list[bytes]:
    body = b"".join(f.payload for f in frames if f.kind == DATA)
    out = []
    while body:
        size = int.from_bytes(body[1:5], "big")
        out.append(body[5 : 5 + size])
        body = body[5 + size :]
    return out


# -- calls ----------------------------------------------------------------------------------
def test_a_unary_response_leaves_in_one_write() -> None:
    async def scenario() -> None:
        connection, wire = connect({"/t.S/Echo": Method(echo)})
        call(connection, 1, message(b"hello"))
        frames = await ended(wire, 1)
        assert wire.batches[-1] == frames  # headers, message, trailers: one write
        assert [f.kind for f in frames] == [HEADERS, DATA, HEADERS]
        head = fields(frames[0].payload)
        assert (head[":status"], head["content-type"]) == ("200", "application/grpc")
        assert messages_of(frames) == [b"hello"] and status(frames) == (0, "")
        assert connection.server.calls == 0 and not connection.calls

    run(scenario)


def test_a_streaming_call_gets_its_messages_whole_however_they_are_cut() -> None:
    async def scenario() -> None:
        connection, wire = connect({"/t.S/Chat": Method(chat, streaming=True)})
        sent = [b"", b"a", b"bc" * 1000, b"d"]
        body = b"".join(message(m) for m in sent)
        connection.data_received(headers(1, request_head(b"/t.S/Chat")))
        for at in range(0, len(body), 3):  # cut inside prefixes and messages
            connection.data_received(data(1, body[at : at + 3]))
        connection.data_received(data(1, b"", end_stream=True))
        frames = await ended(wire, 1)
        assert messages_of(frames) == [m * 2 for m in sent] and status(frames) == (0, "")

    run(scenario)


def test_a_unary_call_needs_exactly_one_message() -> None:
    """grpc/doc/statuscodes.md: a request cardinality violation is UNIMPLEMENTED; a
    second message is refused as it arrives, not gathered."""

    async def scenario() -> None:
        connection, wire = connect({"/t.S/Echo": Method(echo)})
        call(connection, 1)
        call(connection, 3, message(b"a"), message(b"b"))
        connection.data_received(headers(5, request_head()) + data(5, message(b"a")))
        connection.data_received(data(5, message(b"b")))  # the client goes on
        for stream in (1, 3, 5):
            assert status(await ended(wire, stream)) == (
                UNIMPLEMENTED, "a unary call needs exactly one request message"
            )  # fmt: skip
        assert not connection.calls

    run(scenario)


CUT_SHORT = (INTERNAL, "the call ended inside a message: its length prefix says more than was sent")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (message(b"hello") + b"\x00\x00", CUT_SHORT),  # stray bytes after the message
        (message(b"hello")[:-1], CUT_SHORT),  # the prefix says more than the bytes
        (message(b"hello")[:3], CUT_SHORT),  # not even a whole prefix
        # the prefix says less: the rest is read as a second message
        (b"\x00" + (3).to_bytes(4, "big") + b"hello", CUT_SHORT),
        (b"\x00" + (0).to_bytes(4, "big") + message(b"hello"),
         (UNIMPLEMENTED, "a unary call needs exactly one request message")),
        (message(b"hello", compressed=True),
         (INTERNAL, "a compressed message on a call without grpc-encoding")),
        (b"\x02" + message(b"hello")[1:],
         (INTERNAL, "a message's Compressed-Flag must be 0 or 1, not 2")),
    ],
)  # fmt: skip
@pytest.mark.parametrize("cut", [False, True])
def test_a_call_that_breaks_the_framing_ends_with_grpcs_status(
    body: bytes, expected: tuple[int, str], cut: bool
) -> None:
    """Whole or byte by byte, the same status; the handler never runs."""

    async def scenario() -> None:
        held = Held()
        connection, wire = connect({"/t.S/Echo": Method(held)})
        connection.data_received(headers(1, request_head()))
        pieces = [body[at : at + 1] for at in range(len(body))] if cut else [body]
        for piece in pieces:
            connection.data_received(data(1, piece))
        connection.data_received(data(1, b"", end_stream=True))
        assert status(await ended(wire, 1)) == expected
        assert not held.entered.is_set() and not connection.calls

    run(scenario)


def test_a_stream_that_ends_inside_a_message_ends_internal() -> None:
    async def scenario() -> None:
        connection, wire = connect({"/t.S/Chat": Method(chat, streaming=True)})
        connection.data_received(headers(1, request_head(b"/t.S/Chat")))
        connection.data_received(data(1, message(b"ab") + message(b"cd")[:-1], end_stream=True))
        frames = await ended(wire, 1)
        assert status(frames) == CUT_SHORT

    run(scenario)


def test_a_message_larger_than_the_limit_is_resource_exhausted() -> None:
    async def scenario() -> None:
        limits = GrpcLimits(max_message=4)
        connection, wire = connect({"/t.S/Echo": Method(echo)}, limits=limits)
        call(connection, 1, message(b"12345"))
        call(connection, 3, message(b"1234"))
        assert status(await ended(wire, 1)) == (
            RESOURCE_EXHAUSTED, "Received message larger than max (5 vs. 4)"
        )  # fmt: skip
        assert messages_of(await ended(wire, 3)) == [b"1234"]

    run(scenario)


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (request_head(b"/t.S/Nope"), "Method not found: /t.S/Nope"),
        (request_head(method=b"GET"), "Method not found: /t.S/Echo"),
        (request_head(content_type=b"text/plain"), "not a gRPC request"),
    ],
)
def test_what_is_not_a_call_of_the_table_is_unimplemented(block: bytes, expected: str) -> None:
    async def scenario() -> None:
        connection, wire = connect({"/t.S/Echo": Method(echo)})
        connection.data_received(headers(1, block))
        frames = wire.take()
        # trailers-only, then "send no more" to a client that has not ended its side
        assert [f.kind for f in frames] == [HEADERS, RST_STREAM]
        assert status(frames[:1]) == (UNIMPLEMENTED, expected)

    run(scenario)


# -- what the server gives: the status of a failure, a guard ------------------------------------
class Missing(Exception):
    """A failure of the server's own kind."""


FAILURES: dict[bytes, Exception] = {
    b"missing": Missing("no 'ü' at 100%"),
    b"rpc": RpcError(grpc.StatusCode.NOT_FOUND, "gone"),
    b"bug": ValueError("a bug"),
    b"bare": KeyError(),
}


async def failing(request: memoryview, context: Context) -> bytes:
    """Raises the failure its request names."""
    raise FAILURES[bytes(request)]


def test_the_servers_status_of_ends_a_failed_call() -> None:
    def status_of(exc: Exception) -> Status:
        return (NOT_FOUND, f"mapped: {exc}") if isinstance(exc, Missing) else (INTERNAL, "?")

    async def scenario() -> None:
        connection, wire = connect({"/t.S/Echo": Method(failing)}, status_of=status_of)
        call(connection, 1, message(b"missing"))
        frames = await ended(wire, 1)
        assert len(frames) == 1  # trailers-only
        assert fields(frames[0].payload)[":status"] == "200"
        assert status(frames) == (NOT_FOUND, "mapped: no 'ü' at 100%")
        assert b"no '%C3%BC' at 100%25" in frames[0].payload  # percent-encoded on the wire

    run(scenario)


@pytest.mark.parametrize(
    ("failure", "expected"),
    [(b"rpc", (NOT_FOUND, "gone")), (b"bug", (INTERNAL, "a bug")),
     (b"bare", (INTERNAL, "KeyError"))],
)  # fmt: skip
def test_without_its_own_status_of_only_rpc_errors_keep_their_status(
    failure: bytes, expected: tuple[int, str]
) -> None:
    async def scenario() -> None:
        connection, wire = connect({"/t.S/Echo": Method(failing)})
        call(connection, 1, message(failure))
        assert status(await ended(wire, 1)) == expected

    run(scenario)


def test_a_guard_refuses_a_call_from_its_headers_before_its_handler_runs() -> None:
    seen: list[dict[str, str]] = []

    def guard(headers: list[tuple[str, str]]) -> Status | None:
        seen.append(dict(headers))
        return None if ("x-key", "open") in headers else (14, "expecting header 'x-key'")

    async def scenario() -> None:
        held = Held()
        connection, wire = connect({"/t.S/Echo": Method(held, guard=guard)})
        connection.data_received(headers(1, request_head()))  # the client goes on sending
        refused = wire.take()
        assert status(refused[:1]) == (14, "expecting header 'x-key'")
        assert refused[1] == Frame(RST_STREAM, 0, 1, bytes(4))  # NO_ERROR: send no more
        assert seen[0][":path"] == "/t.S/Echo" and not held.entered.is_set()
        call(connection, 3, message(b""), x_key=b"open")
        await held.entered.wait()

    run(scenario)


class NoBang:
    """A screen that refuses a message with a ``!`` in it, and records what it was shown."""

    def __init__(self, shown: list[int]) -> None:
        self.shown = shown

    def __call__(self, data: memoryview, arrived: int) -> None:
        self.shown.append(arrived)
        if b"!" in bytes(data[:arrived]):
            raise Missing("a bang")


def test_a_screen_refuses_a_message_in_pieces_before_the_rest_arrives() -> None:
    """The method's screen sees each piece of a message as it arrives; what it raises ends
    the call at once, through the server's status_of, and the rest of the message is
    dropped, not gathered. A whole message in one frame, and a compressed one, are not
    screened (the handler reads them whole)."""
    shown: list[int] = []

    def status_of(exc: Exception) -> Status:
        return (3, str(exc))

    async def scenario() -> None:
        method = Method(echo, screen=lambda: NoBang(shown))
        connection, wire = connect({"/t.S/Echo": method}, status_of=status_of)
        body = message(b"!" + bytes(3 * FRAME))
        connection.data_received(headers(1, request_head()) + data(1, body[:FRAME]))
        assert status(wire.of(1)) == (3, "a bang") and shown == [FRAME - 5]
        assert wire.of(1)[-1] == Frame(RST_STREAM, 0, 1, bytes(4))  # send no more
        assert not connection.calls
        rest = [body[at : at + FRAME] for at in range(FRAME, len(body), FRAME)]
        connection.data_received(b"".join(data(1, piece) for piece in rest))  # dropped
        assert not wire.closed and not wire.of(1)[2:]
        shown.clear()
        call(connection, 3, message(bytes(3 * FRAME)))  # in four frames: screened, let in
        assert messages_of(await ended(wire, 3)) == [bytes(3 * FRAME)]
        assert shown == [FRAME - 5, 2 * FRAME - 5, 3 * FRAME - 5, 3 * FRAME]
        shown.clear()
        call(connection, 5, message(b"!"))  # whole in one frame: the handler's to read
        assert messages_of(await ended(wire, 5)) == [b"!"] and not shown

    run(scenario)


async def answering(
    requests: AsyncIterator[memoryview | Refused], context: Context
) -> AsyncIterator[bytes]:
    """Echoes each message; a refused one is answered with what the screen raised."""
    async for request in requests:
        if isinstance(request, Refused):
            yield f"refused: {request.error}".encode()
        else:
            yield bytes(request)


def test_a_streaming_handler_gets_what_its_screen_refused_in_the_messages_place() -> None:
    """A stream's message refused as it arrives reaches the handler as ``Refused`` (the
    stream goes on), its rest dropped; the next message is gathered as usual. A stream that
    ends inside a refused message has been cut short, as inside any other."""
    shown: list[int] = []

    async def scenario() -> None:
        method = Method(answering, streaming=True, screen=lambda: NoBang(shown))
        connection, wire = connect({"/t.S/Chat": method})
        bad, good = message(b"!" + bytes(3 * FRAME)), message(bytes(2 * FRAME))
        call(connection, 1, bad, good, path=b"/t.S/Chat")
        frames = await ended(wire, 1)
        assert messages_of(frames) == [b"refused: a bang", bytes(2 * FRAME)]
        assert status(frames) == (0, "")
        assert FRAME - 5 in shown and len(bad) - 5 not in shown  # the rest: not gathered
        call(connection, 3, bad[: 2 * FRAME], path=b"/t.S/Chat")
        assert status(await ended(wire, 3)) == CUT_SHORT

    run(scenario)


def _pattern(size: int, bang_at: int = -1) -> bytes:
    body = bytearray(bytes(b for b in range(256) if b != ord("!")) * (size // 255 + 1))[:size]
    if bang_at >= 0:
        body[bang_at] = ord("!")
    return bytes(body)


@pytest.mark.parametrize(
    ("path", "sizes", "bang_at"),
    [(b"/t.S/Chat", [3 * FRAME, 100_000, 5, 70_000, FRAME - 5, FRAME - 5], -1),
     (b"/t.S/Chat", [300_000, 200_000, 40_000], 150_000),
     (b"/t.S/Echo", [500_000], -1),
     (b"/t.S/Echo", [500_000], 300_000)],
    ids=["streaming", "streaming-refused", "unary", "unary-refused"],
)  # fmt: skip
def test_messages_gathered_from_runs_of_frames_are_those_of_frame_by_frame(
    path: bytes, sizes: list[int], bang_at: int
) -> None:
    """A read of many DATA frames of one stream is gathered in runs (strided copies into the
    message); the messages, the screen's refusals and what the client is sent are the same
    as when each frame comes in a read of its own. A screen that refuses a message in the
    middle of a run: the rest of the run is dropped as the frames one by one are."""
    shown: list[list[int]] = [[], []]

    async def scenario() -> None:
        seen = []
        for one_by_one in (False, True):
            seen_by = shown[one_by_one]
            screen = lambda: NoBang(seen_by)  # noqa: E731, B023 (used before the next turn)
            methods = {
                b"/t.S/Chat": Method(answering, streaming=True, screen=screen),
                b"/t.S/Echo": Method(echo, screen=screen),
            }
            connection, wire = connect({p.decode(): m for p, m in methods.items()})
            messages = [_pattern(size, bang_at if n == 1 or len(sizes) == 1 else -1)
                        for n, size in enumerate(sizes)]  # fmt: skip
            body = b"".join(message(m) for m in messages)
            frames = [data(1, body[at : at + FRAME]) for at in range(0, len(body), FRAME)]
            reads = [headers(1, request_head(path)), *frames, data(1, b"", end_stream=True)]
            for read in reads if one_by_one else [b"".join(reads)]:
                connection.data_received(read)
            answered = messages_of(await ended(wire, 1))
            while connection._backlog is not None or wire.paused:  # the rest of the read
                await asyncio.sleep(0)
            counted = connection._recv_unacked, connection._recv_credit, connection._in_flight
            seen.append((answered, status(wire.of(1)), wire.frames, counted))
        assert seen[0] == seen[1] and shown[0] == shown[1]
        answered, (code, _), _, _ = seen[0]
        if bang_at < 0:
            assert (answered, code) == (messages, 0)
        elif path == b"/t.S/Chat":  # the stream goes on past the refused message
            assert (answered, code) == ([messages[0], b"refused: a bang", messages[2]], 0)
        else:
            assert not answered and code != 0

    run(scenario)


# -- compression ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("encoding", "squeeze"), [(b"gzip", gzip.compress), (b"deflate", zlib.compress)]
)
def test_compressed_messages_reach_the_handler_inflated(
    encoding: bytes, squeeze: Callable[[bytes], bytes]
) -> None:
    async def scenario() -> None:
        connection, wire = connect({"/t.S/Echo": Method(echo)})
        payload = b"abc" * 1000
        call(connection, 1, message(squeeze(payload), compressed=True), grpc_encoding=encoding)
        assert messages_of(await ended(wire, 1)) == [payload]

    run(scenario)


def test_inflate_refuses_what_it_cannot_read() -> None:
    async def scenario() -> None:
        assert await inflate("gzip", memoryview(gzip.compress(b"x")), 10) == b"x"
        code, text = await inflate("gzip", memoryview(b"not gzip"), 10)  # type: ignore[misc]
        assert code == INTERNAL and text.startswith("cannot decompress the message: ")
        truncated = memoryview(gzip.compress(b"x" * 1000)[:-10])
        assert await inflate("gzip", truncated, 10_000) == (
            INTERNAL, "cannot decompress the message: it ends too soon"
        )  # fmt: skip
        assert await inflate("snappy", memoryview(b""), 10) == (
            UNIMPLEMENTED, "Compression algorithm 'snappy' is not supported"
        )  # fmt: skip

    run(scenario)


@pytest.mark.parametrize(
    ("encoding", "squeeze"), [(b"gzip", gzip.compress), (b"deflate", zlib.compress)]
)
@pytest.mark.parametrize("streaming", [False, True])
def test_a_bomb_is_refused_as_soon_as_it_inflates_past_the_limit(
    encoding: bytes, squeeze: Callable[[bytes], bytes], streaming: bool
) -> None:
    """64 MiB of zeros (64 KiB compressed) against a limit of 4 MiB: refused with grpc's
    size message once a piece passes 4 MiB; the loop runs other work between turns."""

    async def scenario() -> None:
        limits = GrpcLimits(max_inflated=4 << 20)
        methods = {"/t.S/Echo": Method(echo), "/t.S/Chat": Method(chat, streaming=True)}
        connection, wire = connect(methods, limits=limits)
        bomb = squeeze(bytes(64 << 20))
        ticks = 0

        async def ticking() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(ticking())
        path = b"/t.S/Chat" if streaming else b"/t.S/Echo"
        call(connection, 1, message(bomb, compressed=True), grpc_encoding=encoding, path=path)
        code, text = status(await ended(wire, 1))
        ticker.cancel()
        assert code == RESOURCE_EXHAUSTED
        assert text.startswith("Received message larger than max (") and text.endswith(
            f" vs. {4 << 20})"
        )
        assert int(text.split("(")[1].split()[0]) <= (4 << 20) + (1 << 20)  # one piece past
        assert ticks >= 4  # the loop ran between the turns

    run(scenario)


# -- a call's end: deadline, reset, lost connection, stopping --------------------------------
def test_a_deadline_ends_the_call_and_cancels_its_handler() -> None:
    async def scenario() -> None:
        held = Held()
        connection, wire = connect({"/t.S/Echo": Method(held)})
        call(connection, 1, message(b""), grpc_timeout=b"20m")
        assert status(await ended(wire, 1)) == (DEADLINE_EXCEEDED, "Deadline Exceeded")
        await held.cancelled.wait()
        assert connection.server.calls == 0

    run(scenario)


def test_a_reset_cancels_the_handler_and_nothing_more_is_sent() -> None:
    async def scenario() -> None:
        held = Held()
        connection, wire = connect({"/t.S/Echo": Method(held)})
        call(connection, 1, message(b""))
        await held.entered.wait()
        connection.data_received(frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big")))
        await held.cancelled.wait()
        assert wire.of(1) == [] and connection.server.calls == 0

    run(scenario)


def test_a_lost_connection_cancels_its_calls() -> None:
    async def scenario() -> None:
        held = Held()
        connection, _ = connect({"/t.S/Echo": Method(held)})
        call(connection, 1, message(b""))
        await held.entered.wait()
        connection.connection_lost(None)
        await held.cancelled.wait()
        server = connection.server
        assert server.calls == 0 and connection not in server.connections

    run(scenario)


def test_a_stopping_server_tells_a_new_connection_to_go_away() -> None:
    async def scenario() -> None:
        server = GrpcServer({}, "127.0.0.1", 0)
        server.stopping = True
        wire = Wire()
        GrpcConnection(server).connection_made(wire)  # type: ignore[arg-type]
        assert [f.kind for f in wire.take()] == [SETTINGS, WINDOW_UPDATE, GOAWAY]

    run(scenario)


# -- tracing --------------------------------------------------------------------------------
class Trace:
    def __init__(self) -> None:
        self.stamps: list[str] = []
        self.released = False

    def stamp(self, name: str, ns: int) -> None:
        self.stamps.append(name)

    def release(self) -> None:
        self.released = True


class Tracing:
    active = True


@pytest.mark.parametrize("fails", [False, True])
def test_tracing_stamps_a_responses_sending_and_releases_its_trace(fails: bool) -> None:
    trace = Trace()

    async def traced(request: memoryview, context: Context) -> bytes:
        assert context.opened_ns > 0  # tracing on: the call noted when it opened
        context.trace = trace
        if fails:
            raise ValueError("after tracing began")
        return b"ok"

    async def scenario() -> None:
        connection, wire = connect({"/t.S/Echo": Method(traced)}, timing=Tracing())
        call(connection, 1, message(b""))
        await ended(wire, 1)
        assert trace.released
        assert trace.stamps == ([] if fails else ["GRPC_SEND_START", "GRPC_SEND_END"])

    run(scenario)


# -- gRPC's header codecs --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2H", 7200.0), ("3M", 180.0), ("5S", 5.0), ("250m", 0.25), ("7u", 7e-6), ("9n", 9e-9),
     ("", None), ("S", None), ("5", None), ("-1S", None), ("1.5S", None), ("5s", None)],
)  # fmt: skip
def test_grpc_timeout(text: str, seconds: float | None) -> None:
    assert parse_timeout(text) == (pytest.approx(seconds) if seconds is not None else None)


def test_status_trailers_percent_encode_their_message() -> None:
    assert fields(trailers(13, "ü 100%\n")) == {
        "grpc-status": "13",
        "grpc-message": "%C3%BC 100%25%0A",
    }
    assert fields(trailers(0, "")) == {"grpc-status": "0"}


def test_a_handler_sees_the_calls_own_metadata() -> None:
    blob = base64.b64encode(b"\x00\xff").rstrip(b"=").decode()  # gRPC sends it unpadded
    headers = [(":path", "/t.S/Echo"), ("content-type", "application/grpc"), ("te", "trailers"),
               ("grpc-timeout", "1S"), ("x-a", "1"), ("blob-bin", blob)]  # fmt: skip
    context = Context("ipv4:127.0.0.1:5000", headers, 42)
    assert context.invocation_metadata() == (("x-a", "1"), ("blob-bin", b"\x00\xff"))
    assert (context.peer(), context.peer_pid()) == ("ipv4:127.0.0.1:5000", 42)


# -- what a connection holds unsent: its send budget ---------------------------------------------
class Large:
    """A handler whose response is ``size`` bytes; the calls it has begun."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.begun: list[int] = []
        self.more = asyncio.Event()

    async def __call__(self, request: memoryview, context: Context) -> bytes:
        self.begun.append(len(self.begun))
        self.more.set()
        return b"x" * self.size


async def settled() -> None:
    """Let every task that can run, run (the scenario's deadline bounds it)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_past_its_send_budget_a_connections_further_calls_wait_until_it_reads() -> None:
    """A client that gives no window: its responses wait in the server; past the budget
    its next call does not run until the client takes what waits."""

    async def scenario() -> None:
        large = Large(60)
        limits = GrpcLimits(send_budget=100, send_timeout=60)
        server = GrpcServer({"/t.S/Echo": Method(large)}, "127.0.0.1", 0, limits=limits)
        connection, wire = GrpcConnection(server), Wire()
        connection.connection_made(wire)  # type: ignore[arg-type]
        connection.data_received(opening(window=0))
        for stream in (1, 3, 5):
            call(connection, stream, message(b""))
        await settled()
        assert large.begun == [0, 1]  # 65 bytes held: the second runs; 130: the third waits
        assert connection.budget.held() == 130
        for stream in (1, 3):
            update = frame(WINDOW_UPDATE, 0, stream, (65).to_bytes(4, "big"))
            connection.data_received(update)
        await settled()
        assert large.begun == [0, 1, 2]
        assert messages_of(wire.of(1)) == [b"x" * 60]

    run(scenario)


def test_a_connection_whose_responses_wait_with_nothing_moving_is_closed_after_the_timeout() -> (
    None
):
    async def scenario() -> None:
        large, held = Large(60), Held()
        limits = GrpcLimits(send_budget=100, send_timeout=0.05)
        methods = {"/t.S/Echo": Method(large), "/t.S/Hold": Method(held)}
        server = GrpcServer(methods, "127.0.0.1", 0, limits=limits)
        connection, wire = GrpcConnection(server), Wire()
        connection.connection_made(wire)  # type: ignore[arg-type]
        connection.data_received(opening(window=0))
        for stream in (1, 3):
            call(connection, stream, message(b""))
        call(connection, 5, message(b""), path=b"/t.S/Hold")  # waits for room
        while not wire.closed:
            await asyncio.sleep(0.01)
        assert not held.entered.is_set()
        connection.connection_lost(None)  # what asyncio does once the socket is dropped
        await settled()
        assert server.calls == 0 and not connection.calls
        assert connection.budget.held() == 0

    run(scenario)


def test_a_stream_takes_its_next_message_only_while_its_connection_is_within_budget() -> None:
    async def scenario() -> None:
        seen: list[int] = []

        async def answer(
            requests: AsyncIterator[memoryview], context: Context
        ) -> AsyncIterator[bytes]:
            async for request in requests:
                seen.append(len(request))
                yield b"x" * 200

        limits = GrpcLimits(send_budget=100, send_timeout=60)
        server = GrpcServer({"/t.S/Chat": Method(answer, streaming=True)}, "127.0.0.1", 0,
                            limits=limits)  # fmt: skip
        connection, wire = GrpcConnection(server), Wire()
        connection.connection_made(wire)  # type: ignore[arg-type]
        connection.data_received(opening(window=0))
        connection.data_received(headers(1, request_head(b"/t.S/Chat")))
        connection.data_received(data(1, message(b"a") + message(b"bb") + message(b"ccc")))
        await settled()
        assert seen == [1]  # 205 bytes wait for window: the next message waits too
        connection.data_received(frame(WINDOW_UPDATE, 0, 1, (205).to_bytes(4, "big")))
        await settled()
        assert seen == [1, 2]

    run(scenario)


def test_what_a_streams_handler_holds_in_its_outbox_counts_until_the_call_ends() -> None:
    """Responses made and not yet handed to the stream (ModelStreamInfer's outbox) are
    unsent bytes of the connection: past its budget, its next call waits; once the stream
    is reset they no longer count and the call runs."""

    async def scenario() -> None:
        large, filled = Large(10), asyncio.Event()

        async def hold(
            requests: AsyncIterator[memoryview], context: Context
        ) -> AsyncIterator[bytes]:
            out = Outbox(holding=context.holding)
            out.put_nowait(b"x" * 60)
            out.put_nowait(b"y" * 50)
            filled.set()
            await asyncio.Event().wait()  # never hands them over
            yield b""

        limits = GrpcLimits(send_budget=100, send_timeout=60)
        methods = {"/t.S/Echo": Method(large), "/t.S/Hold": Method(hold, streaming=True)}
        server = GrpcServer(methods, "127.0.0.1", 0, limits=limits)
        connection, wire = GrpcConnection(server), Wire()
        connection.connection_made(wire)  # type: ignore[arg-type]
        connection.data_received(opening())
        connection.data_received(headers(1, request_head(b"/t.S/Hold")))
        await filled.wait()
        assert connection.budget.held() == 110
        call(connection, 3, message(b""))
        await settled()
        assert large.begun == []  # 110 bytes held: past the budget of 100
        connection.data_received(frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big")))
        await settled()
        assert connection.budget.held() == 0
        assert large.begun == [0]
        assert messages_of(await ended(wire, 3)) == [b"x" * 10]

    run(scenario)
