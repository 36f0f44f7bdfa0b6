"""dlserve's own gRPC server (frontends/grpc: h2, rpc, transport), driven by grpcio clients.

A small method table (echo, a call that waits to be released, failures, a bidirectional
stream) runs on a real server on a free port, on a uvloop loop in a thread; the tests
call it with grpcio's own client, as tritonclient does. Handlers and tests meet on
threading Events: nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import uvloop

from dlserve.errors import FatalError, NotFoundError
from dlserve.frontends.grpc.rpc import Context, Method
from dlserve.frontends.grpc.transport import GrpcServer

DEADLINE_S = 60.0
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


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

    return {
        "/t.S/Echo": Method(echo),
        "/t.S/Held": Method(held),
        "/t.S/NotFound": Method(not_found),
        "/t.S/Broken": Method(broken),
        "/t.S/Chat": Method(chat, streaming=True),
    }


@contextlib.contextmanager
def serving(uds_path: str | None = None) -> Iterator[tuple[GrpcServer, int, Probe]]:
    loop = uvloop.new_event_loop()
    probe = Probe(loop)
    server = GrpcServer(methods(probe), "127.0.0.1", 0, uds_path)
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
    with serving() as (_, port, _), pytest.raises(FatalError, match=f"127.0.0.1:{port}"):
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
