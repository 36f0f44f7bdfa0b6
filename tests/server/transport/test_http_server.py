"""dlserve's HTTP/1.1 server: real servers on free ports, small ASGI apps, real clients
(asyncio streams for raw bytes, http.client and tritonclient.http in threads), on both
uvloop and plain asyncio. Nothing sleeps: apps and tests meet on asyncio Events, and a
few waits yield to the loop until the server reaches a state."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
import tritonclient.http as httpclient
import uvloop

from dlserve.server.transport.http1.exchange import HIGH_WATER
from dlserve.server.transport.http1.listener import HttpServer
from dlserve.server.transport.listen_error import ListenError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Run = Callable[[Coroutine[Any, Any, None]], None]

# --- harness ----------------------------------------------------------------------------------


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request: pytest.FixtureRequest) -> Run:
    """Run a scenario on a fresh event loop of each kind, within a deadline."""

    def runner(scenario: Coroutine[Any, Any, None]) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(60):
                await scenario

        if request.param == "uvloop":
            uvloop.run(bounded())
        else:
            asyncio.run(bounded())

    return runner


@contextlib.asynccontextmanager
async def serving(app: Any, **options: Any) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(app, "127.0.0.1", 0, **options)
    port = await server.start()
    try:
        yield server, port
    finally:
        await server.stop(5.0)


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the event loop until ``predicate()`` holds (the scenario's deadline bounds it)."""
    while not predicate():
        await asyncio.sleep(0)


async def read_response(
    reader: asyncio.StreamReader, *, head: bool = False
) -> tuple[int, dict[str, str], bytes]:
    """One response off the wire: status, headers (lower-case names), body."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in filter(None, lines[1:]):
        name, _, value = line.partition(":")
        assert name.lower() not in headers, f"duplicate header {name}"
        headers[name.lower()] = value.strip()
    if head or status in (100, 204, 304):
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        return status, headers, await _read_chunked(reader)
    return status, headers, await reader.read()  # the body ends with the connection


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        parts.append(await reader.readexactly(size))
        assert await reader.readexactly(2) == b"\r\n"
    assert await reader.readexactly(2) == b"\r\n"
    return b"".join(parts)


async def respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    fields = [(b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": body})


async def read_all(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        assert message["type"] == "http.request"
        body += message["body"]
        if not message["more_body"]:
            return body


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with the request body; says its path and method in headers."""
    body = await read_all(receive)
    path = scope["path"].encode()
    await respond(send, 200, body, [(b"x-path", path), (b"x-method", scope["method"].encode())])


def get(path: str, *extra: str) -> bytes:
    return "\r\n".join([f"GET {path} HTTP/1.1", "Host: x", *extra, "", ""]).encode()


def post(path: str, body: bytes, *extra: str) -> bytes:
    return (
        "\r\n".join(
            [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *extra, "", ""]
        ).encode()
        + body
    )


# --- requests and scopes ----------------------------------------------------------------------


def test_scope(run: Run) -> None:
    scopes: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scopes.append(scope)
        await echo(scope, receive, send)

    async def scenario() -> None:
        async with serving(app) as (_, port), connect(port) as (reader, writer):
            writer.write(post("/v2/a%20b/c?x=1&y=%20", b"hi", "X-Custom: Value"))
            assert (await read_response(reader))[2] == b"hi"
            local = writer.get_extra_info("sockname")
        scope = scopes[0]
        assert scope["type"] == "http" and scope["asgi"]["version"] == "3.0"
        assert (scope["http_version"], scope["method"], scope["scheme"]) == ("1.1", "POST", "http")
        assert (scope["path"], scope["raw_path"]) == ("/v2/a b/c", b"/v2/a%20b/c")
        assert (scope["query_string"], scope["root_path"]) == (b"x=1&y=%20", "")
        assert scope["headers"] == [
            (b"host", b"x"), (b"content-length", b"2"), (b"x-custom", b"Value")
        ]  # fmt: skip
        assert scope["client"] == (local[0], local[1])
        assert scope["server"] == ("127.0.0.1", port)

    run(scenario())


def test_keep_alive_with_http_client(run: Run) -> None:
    clients: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        clients.append(scope["client"])
        await echo(scope, receive, send)

    def three_requests(port: int) -> list[bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            bodies = []
            for index in range(3):
                conn.request("POST", f"/r{index}", body=b"x" * index)
                response = conn.getresponse()
                assert response.status == 200 and response.getheader("x-path") == f"/r{index}"
                bodies.append(response.read())
            return bodies
        finally:
            conn.close()

    async def scenario() -> None:
        async with serving(app) as (_, port):
            assert await asyncio.to_thread(three_requests, port) == [b"", b"x", b"xx"]
        assert len(set(clients)) == 1  # one connection served all three

    run(scenario())


def test_pipelined_requests_are_answered_in_order(run: Run) -> None:
    events: list[str] = []
    slow_started, release = asyncio.Event(), asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        events.append(f"start {scope['path']}")
        if scope["path"] == "/slow":
            slow_started.set()
            await release.wait()
        await echo(scope, receive, send)
        events.append(f"end {scope['path']}")

    async def scenario() -> None:
        async with serving(app) as (server, port), connect(port) as (reader, writer):
            writer.write(get("/slow") + get("/fast") + post("/body", b"payload"))
            await slow_started.wait()
            await until(lambda: server.reading_paused)  # the others wait, parsed
            release.set()
            answers = [await read_response(reader) for _ in range(3)]
        assert [(s, h["x-path"], b) for s, h, b in answers] == [
            (200, "/slow", b""), (200, "/fast", b""), (200, "/body", b"payload")
        ]  # fmt: skip
        assert events == [f"{e} /{p}" for p in ("slow", "fast", "body") for e in ("start", "end")]

    run(scenario())


def test_chunked_request_body_is_streamed_to_the_app(run: Run) -> None:
    got: asyncio.Queue[Message] = asyncio.Queue()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            await got.put(message)
            body += message["body"]
            if not message["more_body"]:
                break
        await respond(send, 200, body)

    async def scenario() -> None:
        async with serving(app) as (_, port), connect(port) as (reader, writer):
            writer.write(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (b"first", b"second!"):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                message = await got.get()  # the app has it before the next chunk is sent
                assert (message["body"], message["more_body"]) == (part, True)
            writer.write(b"0\r\n\r\n")
            assert (await got.get())["more_body"] is False
            status, _, body = await read_response(reader)
            assert (status, body) == (200, b"firstsecond!")

    run(scenario())


def test_disconnect_reaches_a_waiting_app(run: Run) -> None:
    got: asyncio.Queue[Message] = asyncio.Queue()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            await got.put(message)
            if message["type"] == "http.disconnect":
                return

    async def scenario() -> None:
        async with serving(app) as (server, port):
            async with connect(port) as (_, writer):
                writer.write(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
                writer.write(b"3\r\nabc\r\n")
                assert (await got.get())["body"] == b"abc"
            assert (await got.get())["type"] == "http.disconnect"
            await until(lambda: not server.connections)

    run(scenario())


def test_a_broken_chunk_is_answered_400_and_the_app_hears_a_disconnect(run: Run) -> None:
    got: asyncio.Queue[Message] = asyncio.Queue()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:  # reads the body as it comes, as the inference route does
            message = await receive()
            await got.put(message)
            if message["type"] == "http.disconnect":
                return

    async def scenario() -> None:
        async with serving(app) as (server, port), connect(port) as (reader, writer):
            writer.write(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"3\r\nabc\r\n")
            assert (await got.get())["body"] == b"abc"
            writer.write(b"zz\r\nnot a chunk\r\n")
            status, headers, body = await read_response(reader)
            assert (status, headers["connection"], body) == (400, "close", b"Bad Request")
            assert await reader.read() == b""
            assert (await got.get())["type"] == "http.disconnect"
            await until(lambda: not server.connections)

    run(scenario())


def test_request_then_half_close_is_answered(run: Run) -> None:
    async def scenario() -> None:
        async with serving(echo) as (_, port), connect(port) as (reader, writer):
            writer.write(post("/half", b"last words"))
            writer.write_eof()  # the client sends nothing more, and waits for its answer
            status, _, body = await read_response(reader)
            assert (status, body) == (200, b"last words")
            assert await reader.read() == b""  # then the server closes too

    run(scenario())


# --- responses --------------------------------------------------------------------------------


def test_streamed_response_is_chunked(run: Run) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one ", b"", b"two ", b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def scenario() -> None:
        async with serving(app) as (_, port), connect(port) as (reader, writer):
            writer.write(get("/"))
            status, headers, body = await read_response(reader)
            assert (status, headers["transfer-encoding"], body) == (
                200,
                "chunked",
                b"one two three",
            )
            assert "content-length" not in headers
            writer.write(get("/", "Connection: close"))  # still usable; then closed
            assert (await read_response(reader))[2] == b"one two three"
            assert await reader.read() == b""

    run(scenario())


def test_large_response_waits_for_a_slow_reader(run: Run) -> None:
    piece = bytes(range(256)) * 256  # 64 KiB
    count = 256  # 16 MiB in all
    finished = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(count):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        finished.set()

    async def scenario() -> None:
        async with serving(app) as (server, port), connect(port) as (reader, writer):
            writer.write(get("/"))
            await until(lambda: any(c.write_paused for c in server.connections))
            assert not finished.is_set()  # the app waits while the client does not read
            status, _, body = await read_response(reader)
            assert (status, body == piece * count) == (200, True)
            assert finished.is_set()

    run(scenario())


def test_http10_streamed_response_ends_with_the_connection(run: Run) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})

    async def scenario() -> None:
        async with serving(app) as (_, port), connect(port) as (reader, writer):
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            status, headers, body = await read_response(reader)
        assert (status, body, headers["connection"]) == (200, b"ab", "close")
        assert "transfer-encoding" not in headers

    run(scenario())


def test_single_body_gets_a_content_length(run: Run) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": [(b"a", b"b")]})
        await send({"type": "http.response.body", "body": b"whole"})

    async def scenario() -> None:
        async with serving(app, server_header=True) as (_, port), connect(port) as (reader, w):
            w.write(get("/"))
            status, headers, body = await read_response(reader)
        assert (status, headers["content-length"], headers["a"], body) == (201, "5", "b", b"whole")
        assert headers["server"] == "dlserve" and headers["date"].endswith(" GMT")

    run(scenario())


def test_head(run: Run) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"hello")  # like Starlette: the GET body, dropped for HEAD

    def head_then_get(port: int) -> tuple[int, str | None, bytes, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("HEAD", "/")
            response = conn.getresponse()
            head = (response.status, response.getheader("content-length"), response.read())
            conn.request("GET", "/")  # the same connection: no stray body bytes in it
            return (*head, conn.getresponse().read())
        finally:
            conn.close()

    async def scenario() -> None:
        async with serving(app) as (_, port):
            assert await asyncio.to_thread(head_then_get, port) == (200, "5", b"", b"hello")

    run(scenario())


# --- request bodies: flow control, early answers, 100-continue --------------------------------


def test_large_body_is_streamed_with_backpressure(run: Run) -> None:
    """The app reads only once the server has stopped reading: what the server holds then
    stays near HIGH_WATER, though the client sends 64 times as much."""
    size = 64 * HIGH_WATER
    seen: list[int] = []  # bytes the server held each time the app came to read

    async def scenario() -> None:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            taken = [0]
            while True:
                await until(
                    lambda: server.reading_paused or taken[0] + server.buffered_bytes == size
                )
                seen.append(server.buffered_bytes)
                message = await receive()
                taken[0] += len(message["body"])
                if not message["more_body"]:
                    break
            await respond(send, 200, str(taken[0]).encode())

        async with serving(app) as (server, port), connect(port) as (reader, writer):
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            block = b"x" * HIGH_WATER
            for _ in range(size // len(block)):
                writer.write(block)
                await writer.drain()  # blocks while the server does not read
            assert (await read_response(reader))[2] == str(size).encode()
        assert len(seen) > 8  # the app read many times, each time after reading paused
        assert max(seen) <= 2 * HIGH_WATER  # the limit plus at most one read

    run(scenario())


def test_early_answer_discards_the_rest_of_the_body(run: Run) -> None:
    received: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/refuse":
            await respond(send, 400, b"too large")  # from Content-Length, unread
        else:
            received.append(await receive())
            await respond(send, 200, b"ok")

    async def scenario() -> None:
        part = b"y" * HIGH_WATER
        async with serving(app) as (server, port), connect(port) as (reader, writer):
            head = b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
            writer.write(head % (4 * len(part)))
            writer.write(part)  # the client is still sending when the answer comes
            assert (await read_response(reader))[:1] == (400,)
            for _ in range(3):
                writer.write(part)
                await writer.drain()
                assert server.buffered_bytes == 0  # discarded as it comes, not held
            writer.write(get("/next"))  # the connection is still usable
            status, headers, body = await read_response(reader)
            assert (status, body, headers.get("connection")) == (200, b"ok", None)
        assert [m["body"] for m in received] == [b""]

    run(scenario())


def test_expect_100_continue(run: Run) -> None:
    async def scenario() -> None:
        async with serving(echo) as (_, port), connect(port) as (reader, writer):
            writer.write(
                post("/e", b"", "Expect: 100-continue").replace(b"Length: 0", b"Length: 5")
            )
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"hello")
            assert (await read_response(reader))[2] == b"hello"

    run(scenario())


def test_expect_100_continue_refused_closes(run: Run) -> None:
    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 413, b"no")

    async def scenario() -> None:
        async with serving(refuse) as (_, port), connect(port) as (reader, writer):
            writer.write(post("/", b"", "Expect: 100-continue").replace(b"Length: 0", b"Length: 5"))
            status, headers, _ = await read_response(reader)  # no 100 Continue before it
            assert (status, headers["connection"]) == (413, "close")
            assert await reader.read() == b""  # the unsent body cannot be told from a request

    run(scenario())


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [b"GARBAGE\r\n\r\n", get("/", "Content-Length: x"), b"GET /\x01 HTTP/1.1\r\n\r\n"],
)
def test_malformed_request_is_400_then_closed(run: Run, request_bytes: bytes) -> None:
    async def scenario() -> None:
        async with serving(echo) as (_, port), connect(port) as (reader, writer):
            writer.write(get("/ok") + request_bytes)  # the good one is answered first
            assert (await read_response(reader))[0] == 200
            status, headers, _ = await read_response(reader)
            assert (status, headers["connection"]) == (400, "close")
            assert await reader.read() == b""

    run(scenario())


def test_headers_over_the_limit_are_431(run: Run) -> None:
    async def scenario() -> None:
        complete = get("/", "X-Big: " + "b" * 2000)
        unfinished = b"GET / HTTP/1.1\r\nX-Big: " + b"c" * 5000  # no end in sight
        async with serving(echo, max_header_size=1024) as (_, port):
            for request in (complete, unfinished):
                async with connect(port) as (reader, writer):
                    writer.write(request)
                    assert (await read_response(reader))[0] == 431
                    assert await reader.read() == b""

    run(scenario())


def test_app_failures_are_500(run: Run) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/raise":
            raise ValueError("a bug")
        if scope["path"] == "/injection":
            await respond(send, 200, b"", [(b"x-evil", b"a\r\nset-cookie: x")])

    async def scenario() -> None:
        async with serving(app) as (_, port):
            for path in ("/raise", "/silent", "/injection"):
                async with connect(port) as (reader, writer):
                    writer.write(get(path))
                    status, headers, _ = await read_response(reader)
                    assert (status, headers["connection"]) == (500, "close")
                    assert "set-cookie" not in headers

    run(scenario())


def test_cannot_bind_is_fatal(run: Run) -> None:
    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(ListenError, match=f"cannot listen for HTTP on 127.0.0.1:{port}"):
                await HttpServer(echo, "127.0.0.1", port).start()

    run(scenario())


# --- stopping ---------------------------------------------------------------------------------


def test_stop_lets_the_request_in_flight_finish(run: Run) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/hold":
            entered.set()
            await release.wait()
        await respond(send, 200, scope["path"].encode())

    async def scenario() -> None:
        async with serving(app) as (server, port), connect(port) as (idle, idle_writer):
            idle_writer.write(get("/once"))
            assert (await read_response(idle))[2] == b"/once"
            async with connect(port) as (busy, busy_writer):
                busy_writer.write(get("/hold"))
                await entered.wait()
                stopping = asyncio.create_task(server.stop(30.0))
                assert await idle.read() == b""  # the idle keep-alive connection is closed
                with pytest.raises(OSError):
                    await asyncio.open_connection("127.0.0.1", port)  # nothing accepted
                release.set()
                status, headers, body = await read_response(busy)
                assert (status, body, headers["connection"]) == (200, b"/hold", "close")
                assert await busy.read() == b""
                await stopping

    run(scenario())


def test_stop_cancels_what_outlives_the_timeout(run: Run) -> None:
    entered = asyncio.Event()
    outcome: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    async def scenario() -> None:
        async with serving(app) as (server, port), connect(port) as (reader, writer):
            writer.write(get("/"))
            await entered.wait()
            await server.stop(0.05)
            assert await reader.read() == b""
            assert (outcome, server.tasks, server.connections) == (["cancelled"], set(), set())

    run(scenario())


# --- tritonclient against a tiny fake server --------------------------------------------------


def test_tritonclient_http(run: Run) -> None:
    metadata = {"name": "fake", "version": "1", "extensions": []}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_all(receive)
        if scope["path"] == "/v2/health/live":
            await respond(send, 200, b"")
        elif scope["path"] == "/v2":
            await respond(send, 200, json.dumps(metadata).encode())
        else:
            await respond(send, 404, b'{"error": "no such thing"}')

    def use(port: int) -> tuple[bool, Any]:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            return client.is_server_live(), client.get_server_metadata()
        finally:
            client.close()

    async def scenario() -> None:
        async with serving(app) as (_, port):
            assert await asyncio.to_thread(use, port) == (True, metadata)

    run(scenario())
