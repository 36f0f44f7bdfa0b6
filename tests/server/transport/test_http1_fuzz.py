"""Fuzzing the HTTP/1.1 connection's request reader (no socket: bytes into
``data_received``): arbitrary bytes, and well-formed requests (heads, Content-Length and
chunked bodies, pipelining) mutated, each cut into pieces at random points. Whatever
arrives, nothing escapes ``data_received`` or the exchanges' tasks, every answer is a
status line of a success or a 4xx (never a 5xx: the app never fails), and what the
connection holds stays bounded by what it was sent.

The suite runs a fixed, derandomized few; ``tools/fuzz.py http1`` runs them longer, with
random seeds (``fuzzing.py``)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from test_http1_connection import Receive, Send, Transport

from dlserve.server.transport.http1.connection import Connection
from dlserve.server.transport.http1.exchange import HIGH_WATER
from dlserve.server.transport.http1.listener import HttpServer
from fuzzing import fuzz_settings

FUZZ = fuzz_settings(2000, suppress=HealthCheck)
_STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")


async def _app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Reads the whole body, answers its length (as the frontend, a 413 past 1 MiB)."""
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size, more = size + len(message["body"]), message["more_body"]
        if size > HIGH_WATER:
            break
    status = 413 if size > HIGH_WATER else 200
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


_METHOD = st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"OPTIONS", b"CONNECT", b"G T"])
_TOKEN = st.binary(min_size=0, max_size=12)
_HEADER = st.one_of(
    st.tuples(
        st.sampled_from(
            [
                b"host",
                b"content-length",
                b"transfer-encoding",
                b"expect",
                b"connection",
                b"upgrade",
                b"x-a",
            ]
        ),
        _TOKEN,
    ),
    st.tuples(st.just(b"content-length"), st.integers(-5, 1 << 22).map(lambda n: b"%d" % n)),
    st.tuples(st.just(b"transfer-encoding"), st.sampled_from([b"chunked", b"gzip, chunked"])),
)


@st.composite
def _request(draw: st.DrawFn) -> bytes:
    method = draw(_METHOD)
    path = b"/" + draw(st.binary(max_size=16)).replace(b" ", b"")
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.x"]))
    headers = draw(st.lists(_HEADER, max_size=5))
    body = draw(st.binary(max_size=64))
    if draw(st.booleans()):  # chunked framing, possibly lying about the sizes
        chunks = draw(st.lists(st.binary(min_size=1, max_size=16), max_size=3))
        lie = draw(st.integers(-2, 2))
        body = b"".join(b"%x\r\n%s\r\n" % (max(0, len(c) + lie), c) for c in chunks) + b"0\r\n\r\n"
    lines = [method + b" " + path + b" " + version]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(b"".join(draw(st.lists(_request(), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[at:at] = draw(st.sampled_from([b"\r\n", b"\n", b"\r", b":", b" ", b"\x00", b"0"]))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        else:
            del data[at:]
    return bytes(data)


_STREAM = st.one_of(st.binary(max_size=512), _mutated())


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def _drive(data: bytes, cuts: list[int]) -> None:
    failures: list[Any] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: failures.append(context))
        server = HttpServer(_app, "127.0.0.1", 0)
        connection, transport = Connection(server, loop), Transport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        for piece in _pieces(data, cuts):
            if transport.closed:
                break
            connection.data_received(piece)  # nothing may escape
            for _ in range(3):
                await asyncio.sleep(0)
            assert connection.buffered <= HIGH_WATER + len(piece)
            assert len(connection.queue) <= len(data) // 16 + 1
        connection.eof_received()
        for _ in range(20):
            await asyncio.sleep(0)
        connection.connection_lost(None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not server.tasks  # every app returned
        written = bytes(transport.written)
        if written:
            assert written.startswith(b"HTTP/1.1 "), written[:80]
        for status in _STATUS.findall(written):
            assert int(status) < 500 and int(status) not in range(300, 400), written

    asyncio.run(scenario())
    assert not failures, failures


@FUZZ
@given(_STREAM, st.lists(st.integers(0, 1 << 16), max_size=6))
def test_any_bytes_get_an_answer_or_a_4xx_never_an_exception(data: bytes, cuts: list[int]) -> None:
    _drive(data, cuts)


def test_regressions() -> None:
    """Inputs found by the fuzzer, or written by hand, kept."""
    for data in (
        b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\r\nupgrade: x\r\nconnection: upgrade\r\n\r\nGET / HTTP/1.1\r\n\r\n",
        b"CONNECT a:1 HTTP/1.1\r\n\r\n\x00\x01",
        b"POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\nabcdefg",
        b"POST / HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
        b"GET / HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\nabc",
    ):
        _drive(data, [7, 19, 40])
