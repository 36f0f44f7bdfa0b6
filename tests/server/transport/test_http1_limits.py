"""The HTTP/1.1 connection's limits without a socket (``limits.py``): each timeout is
driven by calling the listener's sweep with a clock past its deadline; the write buffer's
high-water mark by calling ``pause_writing`` / ``resume_writing`` as a transport does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_http1_connection import Receive, Send, Transport, respond, run, until

from dlserve.server import options
from dlserve.server.transport.http1.connection import Connection
from dlserve.server.transport.http1.exchange import HIGH_WATER, SLICE
from dlserve.server.transport.http1.limits import Http1Limits
from dlserve.server.transport.http1.listener import HttpServer

LIMITS = Http1Limits(header_timeout=10, body_timeout=10, body_min_rate=100, idle_timeout=20,
                     send_timeout=30)  # fmt: skip


class Recorder(Transport):
    """Also records aborts and each write as it was given (to see slices, not copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = False
        self.parts: list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:  # type: ignore[override]
        self.parts.append(data)
        super().write(data)  # type: ignore[arg-type]

    def abort(self) -> None:
        self.aborted = self.closed = True


def connected(app: Any) -> tuple[HttpServer, Connection, Recorder]:
    server = HttpServer(app, "127.0.0.1", 0, limits=LIMITS)
    connection, transport = Connection(server, asyncio.get_running_loop()), Recorder()
    connection.connection_made(transport)  # type: ignore[arg-type]
    return server, connection, transport


async def answer(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    await respond(send, b"done")


def test_connections_due_together_are_answered_a_few_dozen_a_turn() -> None:
    """Drip-fed connections come due in the same sweep: it answers them 408 a few dozen a
    turn of the loop (2,000 at once held it up to 9 ms at a time), every one in the end."""

    async def scenario() -> None:
        server = HttpServer(answer, "127.0.0.1", 0, limits=LIMITS)
        transports = []
        for _ in range(200):
            connection, transport = Connection(server, asyncio.get_running_loop()), Recorder()
            connection.connection_made(transport)  # type: ignore[arg-type]
            transports.append(transport)
        server.sweep(10.0)
        assert 0 < sum(t.closed for t in transports) < 100
        await until(lambda: all(t.closed for t in transports))
        assert all(t.written.startswith(b"HTTP/1.1 408 ") for t in transports)

    run(scenario)


def test_a_head_due_from_the_connections_start() -> None:
    async def scenario() -> None:
        server, _, transport = connected(answer)
        server.sweep(9.9)
        assert not transport.closed
        server.sweep(10.0)
        assert transport.written.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert b"connection: close" in transport.written and transport.closed
        assert transport.written.endswith(b"(--http-header-timeout)")

    run(scenario)


def test_a_head_due_from_its_first_byte_after_an_idle_time() -> None:
    """After a response the idle timeout runs; a request's first byte starts the head's."""

    async def scenario() -> None:
        server, connection, transport = connected(answer)
        connection.data_received(b"GET / HTTP/1.1\r\n\r\n")
        await until(lambda: transport.written.endswith(b"done"))
        server.sweep(15.0)  # past the first head's deadline: no head is due now
        assert not transport.closed
        connection.data_received(b"GET / HTTP/1.1\r\n")
        server.sweep(24.9)
        assert not transport.closed
        server.sweep(25.0)
        assert transport.closed and transport.written.endswith(b"(--http-header-timeout)")

    run(scenario)


def test_an_idle_connection_is_closed_without_a_word() -> None:
    async def scenario() -> None:
        server, connection, transport = connected(answer)
        connection.data_received(b"GET / HTTP/1.1\r\n\r\n")
        await until(lambda: transport.written.endswith(b"done"))
        written = bytes(transport.written)
        server.sweep(19.9)
        assert not transport.closed
        server.sweep(20.0)
        assert transport.closed and transport.written == written

    run(scenario)


def test_a_body_must_bring_its_minimum_each_window() -> None:
    """100 B/s over 10 s windows: 1000 bytes a window keep it going, 999 do not."""
    taken = asyncio.Event()

    async def reader(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        more = True
        while more:
            more = (await receive())["more_body"]
        taken.set()
        await respond(send, b"done")

    async def scenario() -> None:
        server, connection, transport = connected(reader)
        connection.data_received(b"POST / HTTP/1.1\r\ncontent-length: 100000\r\n\r\n")
        connection.data_received(bytes(1000))
        server.sweep(10.0)
        assert not transport.closed
        connection.data_received(bytes(999))
        server.sweep(20.0)
        assert transport.closed
        assert transport.written.startswith(b"HTTP/1.1 408 ")
        assert transport.written.endswith(b"(--http-body-timeout)")

    run(scenario)


def test_no_body_window_runs_while_reading_is_paused() -> None:
    """The app does not take the body (reading paused past HIGH_WATER): not the client's
    fault, its windows start again."""
    gate = asyncio.Event()

    async def slow(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await gate.wait()

    async def scenario() -> None:
        server, connection, transport = connected(slow)
        connection.data_received(
            b"POST / HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % (4 * HIGH_WATER)
        )
        connection.data_received(bytes(HIGH_WATER + 1))
        assert transport.reading == [False]
        for now in (10.0, 20.0, 30.0):
            server.sweep(now)
        assert not transport.closed
        gate.set()

    run(scenario)


def test_no_request_runs_while_the_client_leaves_a_response_unread() -> None:
    """Past the write buffer's high-water mark the next request (pipelined, or sent
    later) waits unrun; it runs once the client has read (resume_writing)."""
    started: list[str] = []

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        started.append(scope["path"])
        await respond(send, scope["path"].encode())

    async def scenario() -> None:
        _, connection, transport = connected(app)
        connection.data_received(b"GET /first HTTP/1.1\r\n\r\n")
        await until(lambda: transport.written.endswith(b"/first"))
        connection.pause_writing()  # the response sits in the transport's buffer
        connection.data_received(b"GET /second HTTP/1.1\r\n\r\nGET /third HTTP/1.1\r\n\r\n")
        for _ in range(10):
            await asyncio.sleep(0)
        assert started == ["/first"] and transport.reading == [False]
        connection.resume_writing()
        await until(lambda: transport.written.endswith(b"/third"))
        assert started == ["/first", "/second", "/third"]

    run(scenario)


def test_a_client_that_does_not_read_is_dropped_after_the_send_timeout() -> None:
    async def scenario() -> None:
        server, connection, transport = connected(answer)
        connection.data_received(b"GET / HTTP/1.1\r\n\r\n")
        await until(lambda: transport.written.endswith(b"done"))
        server.sweep(1.0)
        connection.pause_writing()
        server.sweep(30.9)
        assert not transport.aborted
        server.sweep(31.0)
        assert transport.aborted

    run(scenario)


def test_a_large_body_leaves_in_slices_of_the_apps_buffer() -> None:
    """Each slice is a view of the app's body (no copy), and after each the send waits
    for the client while the write buffer is past its mark."""
    body = bytes(2 * SLICE + 5)

    async def large(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async def scenario() -> None:
        _, connection, transport = connected(large)
        transport_write = transport.write

        def write(data: bytes | memoryview) -> None:
            transport_write(data)
            if len(data) == SLICE:
                connection.pause_writing()  # as a transport past its high-water mark

        transport.write = write  # type: ignore[method-assign]
        connection.data_received(b"GET / HTTP/1.1\r\n\r\n")
        for parts in (2, 3):  # the head and one slice, then another
            await until(lambda n=parts: len(transport.parts) == n)  # type: ignore[misc]
            for _ in range(10):
                await asyncio.sleep(0)
            assert len(transport.parts) == parts  # waits for the client
            connection.resume_writing()
        await until(
            lambda: len(transport.written) == len(body) + transport.written.index(b"\r\n\r\n") + 4
        )
        head, *slices = transport.parts
        assert b"content-length: %d\r\n" % len(body) in bytes(head)
        assert [len(s) for s in slices if len(s)] == [SLICE, SLICE, 5]
        assert all(isinstance(s, memoryview) and s.obj is body for s in slices if len(s))

    run(scenario)


def test_a_large_body_to_a_fast_reader_leaves_a_slice_a_turn() -> None:
    """A client that reads as fast as the socket takes the slices never pauses writing;
    the loop still runs its other work between two slices, not the whole body at once."""
    body = bytes(3 * SLICE)

    async def large(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        _, connection, transport = connected(large)
        turns = 0  # another client's work: a callback each turn of the loop
        at_slice: list[int] = []

        def other() -> None:
            nonlocal turns
            turns += 1
            if len(at_slice) < 3:
                loop.call_soon(other)

        transport_write = transport.write

        def write(data: bytes | memoryview) -> None:
            transport_write(data)
            if len(data) == SLICE:
                at_slice.append(turns)

        transport.write = write  # type: ignore[method-assign]
        loop.call_soon(other)
        connection.data_received(b"GET / HTTP/1.1\r\n\r\n")
        await until(lambda: len(at_slice) == 3)
        assert at_slice[0] < at_slice[1] < at_slice[2], at_slice

    run(scenario)


def test_the_options_defaults_and_off() -> None:
    parse = options.parser().parse_args
    args = parse(["serve", "--model-repository", "."])
    assert Http1Limits() == Http1Limits(
        max_connections=args.http_max_connections, header_timeout=args.http_header_timeout,
        body_timeout=args.http_body_timeout, body_min_rate=args.http_body_min_rate,
        idle_timeout=args.http_idle_timeout, send_timeout=args.http_send_timeout,
    )  # fmt: skip
    assert args.grpc_max_connections == 4096
    off = parse(["serve", "--model-repository", ".", "--http-header-timeout", "0",
                 "--http-max-connections", "0", "--grpc-max-connections", "0"])  # fmt: skip
    assert off.http_header_timeout is None and off.http_max_connections is None
    assert off.grpc_max_connections is None
    with pytest.raises(SystemExit):
        parse(["serve", "--model-repository", ".", "--http-idle-timeout", "-1"])


def test_no_timeout_fires_when_all_are_off() -> None:
    limits = Http1Limits(None, None, None, 0, None, None)
    assert limits.sweep_interval() == 1.0

    async def scenario() -> None:
        server = HttpServer(answer, "127.0.0.1", 0, limits=limits)
        connection, transport = Connection(server, asyncio.get_running_loop()), Recorder()
        connection.connection_made(transport)  # type: ignore[arg-type]
        connection.data_received(b"POST / HTTP/1.1\r\ncontent-length: 10\r\n\r\n")
        connection.pause_writing()
        server.sweep(1e9)
        assert not transport.closed

    run(scenario)
