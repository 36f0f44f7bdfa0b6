"""Fuzz targets of the gRPC edge and of the server<->worker codec, shared by the suite's
bounded runs (``tests/server/.../test_*_fuzz.py``) and the long runs of
``tools/fuzz.py grpc``.

Each target is a check of one input and the strategy that makes its inputs: arbitrary
bytes, and valid messages mutated (bytes flipped, inserted, deleted, cut off). What each
check asserts is what the decoder promises:

- ``infer-request``: ``convert.parse_infer_request`` (and ``request_id_of``) on any bytes
  either succeeds or raises InvalidArgumentError, within a bounded time;
- ``arriving-request``: ``convert.ArrivingRequest`` shown the same bytes as they arrive,
  in any pieces, then looked at until it has walked them all, raises what
  ``split_infer_request`` raises for them whole (or nothing);
- ``grpc-messages``: a gRPC call whose DATA is any bytes, cut anywhere, unary or
  streaming, compressed or not, ends with a status gRPC names for it (OK, INTERNAL,
  UNIMPLEMENTED, RESOURCE_EXHAUSTED); the connection's reader never raises and the call
  is gone once it ends;
- ``ipc-codec``: either direction's ``Decoder.decode`` on any header either succeeds or
  raises UnreadableFrame, allocating no more than a bounded multiple of its size.
"""

from __future__ import annotations

import asyncio
import gzip
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from dlserve.errors import InvalidArgumentError
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.server.frontends.grpc import convert
from dlserve.server.transport.grpc.calls import Context, Method
from dlserve.server.transport.grpc.limits import GrpcLimits
from dlserve.server.transport.grpc.listener import GrpcServer
from dlserve.server.transport.grpc.rpc import GrpcConnection
from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    MAX_WINDOW,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)


# -- mutation -------------------------------------------------------------------------------
@st.composite
def mutated(draw: st.DrawFn, seeds: st.SearchStrategy[bytes]) -> bytes:
    """A seed with a few bytes flipped, inserted, deleted, or its end cut off."""
    data = bytearray(draw(seeds))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(("flip", "insert", "delete", "cut")))
        at = draw(st.integers(0, len(data)))
        if kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif data and at < len(data):
            if kind == "flip":
                data[at] = draw(st.integers(0, 255))
            elif kind == "delete":
                del data[at : at + draw(st.integers(1, 8))]
            else:
                del data[at:]
    return bytes(data)


def inputs(seeds: st.SearchStrategy[bytes], max_size: int = 512) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=max_size), mutated(seeds))


# -- infer-request ------------------------------------------------------------------------------
_DATATYPES = ("FP32", "INT32", "BYTES", "UINT8", "BOOL", "INT64", "FP64")


@st.composite
def infer_requests(draw: st.DrawFn) -> bytes:
    """A ModelInferRequest as a client might send it: inputs with raw contents or typed
    contents, requested outputs, parameters."""
    message = pb.ModelInferRequest(
        model_name=draw(st.text(max_size=8)), id=draw(st.text(max_size=4))
    )
    message.model_version = draw(st.sampled_from(("", "1", "x", "-1")))
    for index in range(draw(st.integers(0, 3))):
        tensor = message.inputs.add(name=f"I{index}", datatype=draw(st.sampled_from(_DATATYPES)))
        tensor.shape.extend(draw(st.lists(st.integers(-2, 4), max_size=3)))
        if draw(st.booleans()):
            message.raw_input_contents.append(draw(st.binary(max_size=16)))
        elif draw(st.booleans()):
            tensor.contents.int_contents.extend(draw(st.lists(st.integers(-5, 5), max_size=4)))
        if draw(st.booleans()):
            tensor.parameters["shared_memory_region"].string_param = draw(st.text(max_size=4))
    for index in range(draw(st.integers(0, 2))):
        message.outputs.add(name=f"O{index}")
    if draw(st.booleans()):
        message.parameters["priority"].int64_param = draw(st.integers(-3, 3))
    return message.SerializeToString()


INFER_REQUEST = inputs(infer_requests())


def check_infer_request(data: bytes) -> None:
    started = time.perf_counter()
    try:
        convert.parse_infer_request(data)
    except InvalidArgumentError:
        pass
    convert.request_id_of(data)
    assert time.perf_counter() - started < 0.5


# -- arriving-request ---------------------------------------------------------------------------
ARRIVING_REQUEST = st.tuples(
    INFER_REQUEST,
    st.lists(st.integers(0, 600), max_size=6),  # how much has arrived at each look
    st.sampled_from((2, 5, convert.MAX_FIELDS)),  # max_fields
)


def _error(walk: Callable[[], object]) -> str | None:
    try:
        walk()
    except InvalidArgumentError as exc:
        return str(exc)
    return None


def check_arriving_request(case: tuple[bytes, list[int], int]) -> None:
    data, looks, max_fields = case
    whole = _error(lambda: convert.split_infer_request(data, max_fields))
    screen, view = convert.ArrivingRequest(max_fields), memoryview(data)

    def pieces() -> None:
        for arrived in sorted({min(look, len(data)) for look in looks}):
            screen(view, arrived)
        looks_left = max_fields // convert.ArrivingRequest._FIELDS_PER_LOOK + 2
        for _ in range(looks_left):  # the rest, a look's fields at a time
            screen(view, len(data))

    assert _error(pieces) == whole


# -- grpc-messages ------------------------------------------------------------------------------
async def _echo(request: memoryview, context: Context) -> bytes:
    return bytes(request)


async def _chat(requests: AsyncIterator[memoryview], context: Context) -> AsyncIterator[bytes]:
    async for request in requests:
        yield bytes(request)


_METHODS = {"/t.S/Echo": Method(_echo), "/t.S/Chat": Method(_chat, streaming=True)}
_STATUSES = {
    0, grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNIMPLEMENTED.value[0],
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
}  # fmt: skip


def _message(payload: bytes, flag: int) -> bytes:
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


@st.composite
def grpc_bodies(draw: st.DrawFn) -> bytes:
    """Length-prefixed messages, some compressed, back to back."""
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        payload = draw(st.binary(max_size=64))
        squeeze = draw(st.sampled_from((None, gzip.compress, zlib.compress)))
        out += _message(payload, 0) if squeeze is None else _message(squeeze(payload), 1)
    return out


GRPC_MESSAGES = st.tuples(
    inputs(grpc_bodies()),
    st.lists(st.integers(0, 600), max_size=6),  # where the DATA is cut
    st.booleans(),  # streaming
    st.sampled_from((b"identity", b"gzip", b"deflate", b"snappy")),
)


class _Sink:
    """A connection's output that keeps only whether its stream ended, and how."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.status: int | None = None
        self._decoder = hpack_codec.Decoder()

    def write(self, data: bytes) -> None:
        self.writelines([data])

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        for part in parts:
            self.buffer += part
        while len(self.buffer) >= 9:
            size = int.from_bytes(self.buffer[:3], "big")
            if len(self.buffer) < 9 + size:
                return
            kind, flags, payload = self.buffer[3], self.buffer[4], bytes(self.buffer[9 : 9 + size])
            del self.buffer[: 9 + size]
            if kind == HEADERS:
                fields = dict(self._decoder.decode(payload))
                if flags & END_STREAM:
                    self.status = int(fields["grpc-status"])

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:  # the connection's turns: every read is fed anyway
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def check_grpc_messages(case: tuple[bytes, list[int], bool, bytes]) -> None:
    body, cuts, streaming, encoding = case

    async def scenario() -> None:
        limits = GrpcLimits(max_message=256, max_inflated=256)
        connection, sink = (
            GrpcConnection(GrpcServer(_METHODS, "127.0.0.1", 0, limits=limits)),
            _Sink(),
        )
        connection.connection_made(sink)  # type: ignore[arg-type]
        settings = b"\x00\x04" + MAX_WINDOW.to_bytes(4, "big")
        connection.data_received(
            PREFACE + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65535).to_bytes(4, "big"))
        )  # fmt: skip
        path = b"/t.S/Chat" if streaming else b"/t.S/Echo"
        block = hpack_codec.encode([
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"x"),
            (b"content-type", b"application/grpc"), (b"grpc-encoding", encoding),
        ])  # fmt: skip
        connection.data_received(frame(HEADERS, END_HEADERS, 1, block))
        at = 0
        for cut in [*sorted({min(c, len(body)) for c in cuts}), len(body)]:
            connection.data_received(frame(DATA, 0, 1, body[at:cut]))
            at = cut
        connection.data_received(frame(DATA, END_STREAM, 1))
        async with asyncio.timeout(5):
            while sink.status is None:
                await asyncio.sleep(0)
        assert sink.status in _STATUSES, sink.status
        await asyncio.sleep(0)
        assert not connection.calls and connection.server.calls == 0

    asyncio.run(scenario())


# -- ipc-codec ----------------------------------------------------------------------------------
def _seed_headers() -> list[bytes]:
    ref = m.TensorRef("INPUT0", "FP32", [1, 4], m.Where.PAYLOAD, 0, 16)
    messages: list[m._Msg] = [
        m.Infer(rid=7, request_id="r", inputs=[ref], parameters={"p": 1}),
        m.Cancel(3),
        m.Release([0, 64]),
        m.InferDone(rid=7, outputs=[ref], parameters={"k": "v"}),
        m.InferDone(rid=8, error="bad", error_code="INVALID_ARG"),
    ]
    return [bytes(codec.encode(message)[1]) for message in messages]


IPC_HEADERS = inputs(st.sampled_from(_seed_headers()), max_size=256)
_ALLOCATION_FACTOR = 64  # a header may decode to this many times its size, and 64 KiB more


def check_ipc_codec(header: bytes) -> None:
    tracing = tracemalloc.is_tracing()
    if tracing:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
    for decoder in (codec.to_worker, codec.to_server):
        try:
            decoder.decode(header)
        except codec.UnreadableFrame as exc:
            assert exc.what and (exc.ident is None or isinstance(exc.ident, int))
    if tracing:
        grown = tracemalloc.get_traced_memory()[1] - before
        assert grown <= _ALLOCATION_FACTOR * len(header) + (64 << 10), grown


TARGETS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], None]]] = {
    "infer-request": (INFER_REQUEST, check_infer_request),
    "arriving-request": (ARRIVING_REQUEST, check_arriving_request),
    "grpc-messages": (GRPC_MESSAGES, check_grpc_messages),
    "ipc-codec": (IPC_HEADERS, check_ipc_codec),
}
