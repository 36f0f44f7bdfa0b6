"""dlserve's own gRPC server (server/transport: h2, grpc), driven by grpcio clients.

A small method table (echo, a call that waits to be released, failures, a bidirectional
stream) runs on a real server on a free port, on a uvloop loop in a thread; the tests
call it with grpcio's own client, as tritonclient does. The server is given its own
mapping of failures to statuses, as the frontends give theirs. Handlers and tests meet on
threading Events: nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import uvloop

from dlserve.server.transport.grpc import status
from dlserve.server.transport.grpc.calls import Context, Method, Parts
from dlserve.server.transport.grpc.listener import GrpcServer
from dlserve.server.transport.h2 import frames as h2
from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.limits import Limits
from dlserve.server.transport.listen_error import ListenError

DEADLINE_S = 60.0
FLOOD = 64  # responses of 1 MiB
TENSOR = np.arange(3 * 50_000, dtype=np.float32).reshape(3, 50_000)
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class NotFoundError(Exception):
    """A failure of the server's own kind: its ``status_of`` knows it."""


def status_of(exc: Exception) -> status.Status:
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND.value[0], str(exc)
    return status.status_of(exc)


class Probe:
    """What the handlers saw, and the gate a held call waits on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.gate = asyncio.Event()
        self.entered = threading.Event()
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.metadata: tuple[tuple[str, str | bytes], ...] = ()
        self.peer = ""
        self.server: GrpcServer | None = None
        self.most_queued = 0  # by a Flood call, seen each time it goes on

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.gate.set)


def methods(probe: Probe) -> dict[str, Method]:
    async def echo(request: memoryview, context: Context) -> bytes:
        probe.metadata, probe.peer = context.invocation_metadata(), context.peer()
        return bytes(request)

    async def held(request: memoryview, context: Context) -> bytes:
        probe.entered.set()
        try:
            await probe.gate.wait()
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        probe.finished.set()
        return b"done"

    async def not_found(request: memoryview, context: Context) -> bytes:
        raise NotFoundError(bytes(request).decode())

    async def broken(request: memoryview, context: Context) -> bytes:
        raise ValueError("a bug")

    async def chat(requests: AsyncIterator[memoryview], context: Context) -> AsyncIterator[bytes]:
        async for request in requests:
            if bytes(request) == b"fail":
                raise NotFoundError("asked to fail")
            yield bytes(request) * 2

    async def flood(requests: AsyncIterator[memoryview], context: Context) -> AsyncIterator[bytes]:
        async for _ in requests:
            pass
        for index in range(FLOOD):
            assert probe.server is not None
            queued = [s.queued for c in probe.server.connections for s in c.streams.values()]
            probe.most_queued = max(probe.most_queued, *queued, 0)
            yield bytes([index]) * 2**20

    async def tensor(request: memoryview, context: Context) -> Parts:
        view = memoryview(TENSOR)  # a typed, shaped view, as a model's output is
        return [b"head:", view], 5 + view.nbytes

    async def gated_sink(
        requests: AsyncIterator[memoryview], context: Context
    ) -> AsyncIterator[bytes]:
        await probe.gate.wait()
        count = 0
        async for _ in requests:
            count += 1
        yield str(count).encode()

    return {
        "/t.S/GatedSink": Method(gated_sink, streaming=True),
        "/t.S/Tensor": Method(tensor),
        "/t.S/Flood": Method(flood, streaming=True),
        "/t.S/Echo": Method(echo),
        "/t.S/Held": Method(held),
        "/t.S/NotFound": Method(not_found),
        "/t.S/Broken": Method(broken),
        "/t.S/Chat": Method(chat, streaming=True),
    }


@contextlib.contextmanager
def serving(
    uds_path: str | None = None, limits: Limits = Limits(),  # noqa: B008 (frozen)
) -> Iterator[tuple[GrpcServer, int, Probe]]:  # fmt: skip
    loop = uvloop.new_event_loop()
    probe = Probe(loop)
    server = GrpcServer(methods(probe), "127.0.0.1", 0, uds_path, status_of=status_of, http2=limits)
    probe.server = server
    port = loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server, port, probe
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(5.0), loop).result(DEADLINE_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(DEADLINE_S)
        loop.close()


@pytest.fixture
def served() -> Iterator[tuple[GrpcServer, grpc.Channel, Probe]]:
    with (
        serving() as (server, port, probe),
        grpc.insecure_channel(f"127.0.0.1:{port}", UNLIMITED) as channel,
    ):
        yield server, channel, probe


def _call(channel: grpc.Channel, name: str) -> Any:
    return channel.unary_unary(f"/t.S/{name}")


def _status(call: Any, request: bytes, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, **kwargs)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("size", [0, 1, 65_536, 20 * 2**20])
def test_echo_of_any_size(served: tuple[GrpcServer, grpc.Channel, Probe], size: int) -> None:
    """20 MiB exceeds the client's first flow-control windows both ways."""
    _, channel, _ = served
    payload = os.urandom(size)
    assert _call(channel, "Echo")(payload, timeout=DEADLINE_S) == payload


def test_a_response_of_typed_views(served: tuple[GrpcServer, grpc.Channel, Probe]) -> None:
    """Pieces that are a tensor's own views (float32, two dimensions) go as their bytes."""
    _, channel, _ = served
    assert _call(channel, "Tensor")(b"", timeout=DEADLINE_S) == b"head:" + TENSOR.tobytes()


def test_concurrent_calls_on_one_connection(served: tuple[GrpcServer, grpc.Channel, Probe]) -> None:
    _, channel, _ = served
    echo = _call(channel, "Echo")
    payloads = [os.urandom(n * 997) for n in range(200)]
    futures = [echo.future(p, timeout=DEADLINE_S) for p in payloads]
    assert [f.result() for f in futures] == payloads


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_compressed_requests(
    served: tuple[GrpcServer, grpc.Channel, Probe], compression: grpc.Compression
) -> None:
    _, channel, _ = served
    payload = b"abc" * 100_000
    echo = _call(channel, "Echo")
    assert echo(payload, compression=compression, timeout=DEADLINE_S) == payload


def test_metadata_and_peer(served: tuple[GrpcServer, grpc.Channel, Probe]) -> None:
    _, channel, probe = served
    metadata = (("dlserve-client-pid", "123"), ("blob-bin", b"\x00\xff"))
    _call(channel, "Echo")(b"x", metadata=metadata, timeout=DEADLINE_S)
    assert ("dlserve-client-pid", "123") in probe.metadata
    assert ("blob-bin", b"\x00\xff") in probe.metadata
    assert probe.peer.startswith("ipv4:127.0.0.1:")


def test_errors_end_calls_with_their_status(
    served: tuple[GrpcServer, grpc.Channel, Probe],
) -> None:
    _, channel, _ = served
    text = "no model 'ü' at 100% \n here"
    assert _status(_call(channel, "NotFound"), text.encode()) == (grpc.StatusCode.NOT_FOUND, text)
    assert _status(_call(channel, "Broken"), b"") == (grpc.StatusCode.INTERNAL, "a bug")
    code, details = _status(_call(channel, "Nope"), b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED and "/t.S/Nope" in details
    assert _call(channel, "Echo")(b"still serving", timeout=DEADLINE_S) == b"still serving"


def test_deadline_cancels_the_handler(served: tuple[GrpcServer, grpc.Channel, Probe]) -> None:
    _, channel, probe = served
    code, _ = _status(_call(channel, "Held"), b"", timeout=0.3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert probe.cancelled.wait(DEADLINE_S)
    assert not probe.finished.is_set()


def test_client_cancel_cancels_the_handler(served: tuple[GrpcServer, grpc.Channel, Probe]) -> None:
    _, channel, probe = served
    future = _call(channel, "Held").future(b"", timeout=DEADLINE_S)
    assert probe.entered.wait(DEADLINE_S)
    future.cancel()
    assert probe.cancelled.wait(DEADLINE_S)


def test_a_closed_connection_cancels_its_calls() -> None:
    with serving() as (_, port, probe):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", UNLIMITED)
        held = _call(channel, "Held").future(b"", timeout=DEADLINE_S)
        assert probe.entered.wait(DEADLINE_S)
        channel.close()
        assert held.cancelled() or held.exception() is not None
        assert probe.cancelled.wait(DEADLINE_S)


def test_bidirectional_stream(served: tuple[GrpcServer, grpc.Channel, Probe]) -> None:
    _, channel, _ = served
    chat = channel.stream_stream("/t.S/Chat")
    requests = [os.urandom(n) for n in (0, 5, 70_000, 3 * 2**20, 17)]
    assert list(chat(iter(requests), timeout=DEADLINE_S)) == [r * 2 for r in requests]


def test_a_stream_ends_with_its_error(served: tuple[GrpcServer, grpc.Channel, Probe]) -> None:
    _, channel, _ = served
    responses = channel.stream_stream("/t.S/Chat")(iter([b"a", b"fail", b"b"]), timeout=DEADLINE_S)
    assert next(responses) == b"aa"
    with pytest.raises(grpc.RpcError) as info:
        next(responses)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.NOT_FOUND, "asked to fail")


def test_stop_lets_the_call_in_flight_finish() -> None:
    with (
        serving() as (server, port, probe),
        grpc.insecure_channel(f"127.0.0.1:{port}", UNLIMITED) as channel,
    ):
        held = _call(channel, "Held").future(b"", timeout=DEADLINE_S)
        assert probe.entered.wait(DEADLINE_S)
        stopping = asyncio.run_coroutine_threadsafe(server.stop(DEADLINE_S), probe.loop)
        probe.release()
        assert held.result() == b"done"
        stopping.result(DEADLINE_S)
        code, _ = _status(_call(channel, "Echo"), b"after", timeout=DEADLINE_S)
        assert code == grpc.StatusCode.UNAVAILABLE


def test_stop_cancels_calls_that_outlive_its_timeout() -> None:
    with (
        serving() as (server, port, probe),
        grpc.insecure_channel(f"127.0.0.1:{port}", UNLIMITED) as channel,
    ):
        held = _call(channel, "Held").future(b"", timeout=DEADLINE_S)
        assert probe.entered.wait(DEADLINE_S)
        asyncio.run_coroutine_threadsafe(server.stop(0.2), probe.loop).result(DEADLINE_S)
        assert probe.cancelled.wait(DEADLINE_S)
        with pytest.raises(grpc.RpcError):
            held.result()


def test_unix_socket(tmp_path: Any) -> None:
    path = str(tmp_path / "grpc.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a socket file nobody listens on: replaced
    stale.close()
    with serving(path) as (_, _, probe), grpc.insecure_channel(f"unix:{path}") as channel:
        assert _call(channel, "Echo")(b"over unix", timeout=DEADLINE_S) == b"over unix"
        assert probe.peer.startswith("unix:")
    assert not os.path.exists(path)


def test_a_taken_port_is_an_error() -> None:
    with serving() as (_, port, _), pytest.raises(ListenError, match=f"127.0.0.1:{port}"):
        asyncio.run(GrpcServer({}, "127.0.0.1", port).start())


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + b"\x00\x00\x05\x04\x00\x00\x00\x00\x00"
        + bytes(5),  # SETTINGS
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + b"\x00\x00\x04\x01\x05\x00\x00\x00\x01\xff\xff\xff\xff",
    ],
)
def test_garbage_closes_only_its_connection(garbage: bytes) -> None:
    with (
        serving() as (_, port, _),
        grpc.insecure_channel(f"127.0.0.1:{port}", UNLIMITED) as channel,
    ):
        assert _call(channel, "Echo")(b"before", timeout=DEADLINE_S) == b"before"
        with socket.create_connection(("127.0.0.1", port), DEADLINE_S) as sock:
            sock.sendall(garbage)
            with contextlib.suppress(OSError):
                while sock.recv(65536):  # until the server closes it
                    pass
        assert _call(channel, "Echo")(b"after", timeout=DEADLINE_S) == b"after"


def _raw_frames(sock: socket.socket) -> Iterator[tuple[int, int, int, bytes]]:
    """Frames (type, flags, stream, payload) the server sends, until it closes."""
    buffer = b""
    while True:
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
            size = int.from_bytes(buffer[:3], "big")
            stream = int.from_bytes(buffer[5:9], "big")
            yield buffer[3], buffer[4], stream, buffer[9 : 9 + size]
            buffer = buffer[9 + size :]
        chunk = sock.recv(65536)
        if not chunk:
            return
        buffer += chunk


def test_a_message_larger_than_the_limit_is_refused() -> None:
    """A length prefix over 2 GiB - 1 ends the call with RESOURCE_EXHAUSTED before any
    of its bytes are kept (a raw HTTP/2 client: grpcio will not send such a prefix)."""
    request_headers = hpack_codec.encode([
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/t.S/Echo"),
        (b":authority", b"x"), (b"content-type", b"application/grpc"),
    ])  # fmt: skip
    with serving() as (_, port, _), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(DEADLINE_S)
        sock.sendall(
            h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0)
            + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, request_headers)
            + h2.frame(h2.DATA, 0, 1, b"\x00\x80\x00\x00\x00" + bytes(100))
        )  # fmt: skip
        decoder = hpack_codec.Decoder()
        for kind, _, stream, payload in _raw_frames(sock):
            if kind == h2.HEADERS and stream == 1:
                fields = dict(decoder.decode(payload))
                break
    assert fields["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    assert "larger than max (2147483648 vs. 2147483647)" in fields["grpc-message"]


def _window_update(stream: int, size: int) -> bytes:
    return h2.frame(h2.WINDOW_UPDATE, 0, stream, size.to_bytes(4, "big"))


def test_a_slow_reader_holds_back_its_stream() -> None:
    """A client that reads slowly (64 KiB windows, given back as it reads) makes a streaming
    handler wait: no more than HIGH_WATER bytes queue up for it, and nothing is lost."""
    request_headers = hpack_codec.encode([
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/t.S/Flood"),
        (b":authority", b"x"), (b"content-type", b"application/grpc"),
    ])  # fmt: skip
    with serving() as (_, port, probe), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(DEADLINE_S)
        sock.sendall(
            h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, b"\x00\x04" + (65535).to_bytes(4, "big"))
            + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, request_headers)
            + h2.frame(h2.DATA, h2.END_STREAM, 1, b"\x00" + bytes(4))
        )  # fmt: skip
        received = bytearray()
        for kind, flags, stream, payload in _raw_frames(sock):
            if kind == h2.DATA and stream == 1:
                received += payload
                sock.sendall(_window_update(0, len(payload)) + _window_update(1, len(payload)))
            elif kind == h2.HEADERS and stream == 1 and flags & h2.END_STREAM:
                break
    messages = []
    while received:
        size = int.from_bytes(received[1:5], "big")
        messages.append(bytes(received[5 : 5 + size]))
        del received[: 5 + size]
    assert messages == [bytes([index]) * 2**20 for index in range(FLOOD)]
    assert probe.most_queued <= h2.HIGH_WATER


def _request_head(path: bytes) -> bytes:
    return hpack_codec.encode([
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
        (b":authority", b"x"), (b"content-type", b"application/grpc"),
    ])  # fmt: skip


def _until(frames: Iterator[tuple[int, int, int, bytes]], kind: int, stream: int) -> list[int]:
    """Read frames up to the first of ``kind`` on ``stream``; the kinds seen on stream 1."""
    seen = []
    for got_kind, _, got_stream, _ in frames:
        if got_stream == 1:
            seen.append(got_kind)
        if (got_kind, got_stream) == (kind, stream):
            return seen
    raise AssertionError("the server closed the connection")


def test_a_stream_the_handler_does_not_read_gets_no_more_window() -> None:
    """Messages the handler has not taken hold back the client: their window is given back
    only as the handler takes them (a PING's answer shows what the server did meanwhile)."""
    message = b"\x00" + (2**20 - 5).to_bytes(4, "big") + bytes(2**20 - 5)
    with serving() as (_, port, probe), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(DEADLINE_S)
        frames = _raw_frames(sock)
        sock.sendall(
            h2.PREFACE
            + h2.frame(h2.SETTINGS, 0, 0)
            + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, _request_head(b"/t.S/GatedSink"))
        )
        for _ in range(h2.STREAM_WINDOW // 2**20):  # all the window the stream has
            for at in range(0, len(message), 16384):
                sock.sendall(h2.frame(h2.DATA, 0, 1, message[at : at + 16384]))
        sock.sendall(h2.frame(h2.PING, 0, 0, bytes(8)))
        assert h2.WINDOW_UPDATE not in _until(frames, h2.PING, 0)
        probe.release()
        assert h2.WINDOW_UPDATE in _until(frames, h2.WINDOW_UPDATE, 1)
        for at in range(0, len(message), 16384):
            last = at + 16384 >= len(message)
            sock.sendall(
                h2.frame(h2.DATA, h2.END_STREAM if last else 0, 1, message[at : at + 16384])
            )
        _until(frames, h2.DATA, 1)


def test_an_endless_header_block_closes_the_connection() -> None:
    with serving() as (_, port, _), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(DEADLINE_S)
        sock.sendall(
            h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0)
            + h2.frame(h2.HEADERS, 0, 1, _request_head(b"/t.S/Echo"))
        )  # fmt: skip
        # the last one takes the block past twice SETTINGS_MAX_HEADER_LIST_SIZE
        for _ in range(2 * Limits().max_header_list_size // 16384):
            sock.sendall(h2.frame(h2.CONTINUATION, 0, 1, b"\x40" * 16384))
        goaway = [p for kind, _, _, p in _raw_frames(sock) if kind == h2.GOAWAY]
    assert int.from_bytes(goaway[0][4:8], "big") == h2.ENHANCE_YOUR_CALM


def test_messages_in_pieces_and_frames_larger_than_a_read() -> None:
    """Messages cut anywhere by DATA frames (inside a length prefix, inside a message),
    frames of a megabyte that arrive over several reads (handed on as they arrive), a
    padded one (joined first) and an empty message: each message reaches the handler
    whole and in order."""
    messages = [os.urandom(size) for size in (0, 3, 300_000, 1, 700_000, 2**20)]
    data = b"".join(b"\x00" + len(m).to_bytes(4, "big") + m for m in messages)
    cuts = [0, 2, 7, 600_000, 600_003, len(data)]
    frames = []
    for index, (start, end) in enumerate(itertools.pairwise(cuts)):
        flags = h2.END_STREAM if end == len(data) else 0
        if index == 2:  # a large padded frame
            piece = bytes([7]) + data[start:end] + bytes(7)
            frames.append(h2.frame(h2.DATA, flags | h2.PADDED, 1, piece))
        else:
            frames.append(h2.frame(h2.DATA, flags, 1, data[start:end]))
    whole = h2.MAX_WINDOW.to_bytes(4, "big")
    big_frames = Limits(max_frame_size=h2.MAX_FRAME)
    with (
        serving(limits=big_frames) as (_, port, _),
        socket.create_connection(("127.0.0.1", port)) as sock,
    ):
        sock.settimeout(DEADLINE_S)
        sock.sendall(
            h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, b"\x00\x04" + whole)
            + _window_update(0, h2.MAX_WINDOW - 65535)
            + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, _request_head(b"/t.S/Chat"))
        )  # fmt: skip
        for piece in frames:
            for at in range(0, len(piece), 50_000):  # in writes smaller than the frames
                sock.sendall(piece[at : at + 50_000])
        received = bytearray()
        decoder = hpack_codec.Decoder()
        for kind, flags, stream, payload in _raw_frames(sock):
            if kind == h2.DATA and stream == 1:
                received += payload
            elif kind == h2.HEADERS and stream == 1:
                fields = dict(decoder.decode(payload))
                if flags & h2.END_STREAM:
                    break
    assert fields["grpc-status"] == "0"
    answers = []
    while received:
        size = int.from_bytes(received[1:5], "big")
        answers.append(bytes(received[5 : 5 + size]))
        del received[: 5 + size]
    assert answers == [m * 2 for m in messages]
