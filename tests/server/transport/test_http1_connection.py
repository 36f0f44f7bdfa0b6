"""One HTTP/1.1 connection without a socket: request bytes go in through
``data_received``, and a recorder in the transport's place shows what it writes and when
it pauses and resumes reading. The server is never started: nothing listens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from dlserve.server.transport.http1.connection import Connection
from dlserve.server.transport.http1.exchange import HIGH_WATER
from dlserve.server.transport.http1.listener import HttpServer

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Transport:
    """What the connection writes, and whether it reads (each change of mind recorded)."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.reading: list[bool] = []
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("10.0.0.1", 5000), "sockname": ("10.0.0.2", 8000)}.get(name)

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        for part in parts:
            self.written += part

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading.append(False)

    def resume_reading(self) -> None:
        self.reading.append(True)


def connected(app: Any) -> tuple[Connection, Transport]:
    server = HttpServer(app, "127.0.0.1", 0)
    connection, transport = Connection(server, asyncio.get_running_loop()), Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    return connection, transport


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until ``predicate()`` holds (the scenario's deadline bounds it)."""
    while not predicate():
        await asyncio.sleep(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(30):
            await scenario()

    asyncio.run(bounded())


async def respond(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def test_pipelined_requests_pause_reading_until_their_turn() -> None:
    """The second request is parsed and waits: reading pauses, and resumes when the queue
    is empty again; the answers leave in order."""
    gate = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["path"] == "/first":
            await gate.wait()
        await respond(send, scope["path"].encode())

    async def scenario() -> None:
        connection, transport = connected(app)
        connection.data_received(b"GET /first HTTP/1.1\r\n\r\nGET /second HTTP/1.1\r\n\r\n")
        assert transport.reading == [False] and not transport.written
        gate.set()
        await until(lambda: transport.written.endswith(b"/second"))
        assert transport.reading == [False, True]
        assert transport.written.index(b"/first") < transport.written.index(b"/second")

    run(scenario)


def test_a_body_beyond_high_water_pauses_reading_until_the_app_takes_it() -> None:
    taking = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await taking.wait()
        size, more = 0, True
        while more:
            message = await receive()
            size, more = size + len(message["body"]), message["more_body"]
        await respond(send, str(size).encode())

    async def scenario() -> None:
        connection, transport = connected(app)
        size = 3 * HIGH_WATER
        connection.data_received(b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % size)
        connection.data_received(bytes(HIGH_WATER))
        assert transport.reading == []  # at the limit, not past it
        connection.data_received(bytes(1))
        assert transport.reading == [False] and connection.buffered == HIGH_WATER + 1
        taking.set()
        await until(lambda: transport.reading == [False, True])
        connection.data_received(bytes(size - HIGH_WATER - 1))
        await until(lambda: transport.written.endswith(str(size).encode()))
        assert transport.written.startswith(b"HTTP/1.1 200 OK\r\n")

    run(scenario)


def test_a_malformed_request_is_answered_after_the_one_in_flight() -> None:
    gate = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await gate.wait()
        await respond(send, b"first")

    async def scenario() -> None:
        connection, transport = connected(app)
        connection.data_received(b"GET / HTTP/1.1\r\n\r\nNOT HTTP\r\n\r\n")
        assert not transport.written and not transport.closed
        gate.set()
        await until(lambda: transport.closed)
        first, _, second = bytes(transport.written).partition(b"first")
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        assert second.startswith(b"HTTP/1.1 400 Bad Request\r\n")

    run(scenario)
