"""Frames over a real socketpair: every size, split anywhere, in both channel kinds; a
frame that cannot be read is reported with what could be read of it, and the frames after
it are read as usual; a frame that cannot be encoded is not written at all. The async
channel receives a frame larger than its buffer into a buffer of its own."""

from __future__ import annotations

import asyncio
import socket
import threading

import msgspec
import pytest

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import READ_AHEAD, AsyncChannel, BlockingChannel, ChannelClosed

SIZES = [0, 1, 7, 64, 1000, READ_AHEAD - 40, READ_AHEAD - 12, READ_AHEAD, READ_AHEAD + 1, 300_000]


def _payload(size: int, seed: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(size))


def _frames() -> list[bytes]:
    """Encoded Infer frames of many payload sizes, as one byte string each."""
    frames = []
    for rid, size in enumerate(SIZES * 3):
        buffers = codec.encode(
            m.Infer(rid=rid, request_id=f"r{rid}", inputs=[]), [_payload(size, rid)]
        )
        frames.append(b"".join(bytes(b) for b in buffers))
    return frames


@pytest.mark.parametrize("chunk", [1, 5, 4096, 1 << 20])
def test_blocking_channel_reads_frames_split_anywhere(chunk: int) -> None:
    ours, theirs = socket.socketpair()
    frames = _frames()
    stream = b"".join(frames)

    def write() -> None:
        for start in range(0, len(stream), chunk):
            ours.sendall(stream[start : start + chunk])
        ours.close()

    writer = threading.Thread(target=write)
    writer.start()
    channel = BlockingChannel(theirs, codec.to_worker)
    for rid, size in enumerate(SIZES * 3):
        msg, payload = channel.recv()
        assert isinstance(msg, m.Infer) and msg.rid == rid
        assert bytes(payload) == _payload(size, rid)
        payload[:1] = b"x" * min(1, len(payload))  # payloads are writable buffers
    with pytest.raises(ChannelClosed):
        channel.recv()
    writer.join()
    channel.close()


def test_read_ahead_reads_what_has_arrived_without_waiting() -> None:
    """What a polling reader of several channels relies on: ``read_ahead`` never waits,
    says whether ``recv`` can start at once, and frames come out whole and in order,
    also one larger than the read-ahead buffer and after the writer has gone."""
    ours, theirs = socket.socketpair()
    channel = BlockingChannel(theirs, codec.to_worker)
    frames = _frames()
    assert not channel.read_ahead()  # nothing has come: no wait, and nothing read
    ours.sendall(frames[3] + frames[4])  # two small frames at once
    assert channel.read_ahead()
    for rid in (3, 4):
        msg, payload = channel.recv()
        assert isinstance(msg, m.Infer) and msg.rid == rid
        assert bytes(payload) == _payload(SIZES[rid], rid)
    assert not channel.read_ahead()
    ours.sendall(frames[8])  # READ_AHEAD + 1 bytes of payload: its rest is waited for
    assert channel.read_ahead()
    msg, payload = channel.recv()
    assert isinstance(msg, m.Infer) and bytes(payload) == _payload(SIZES[8], 8)
    ours.close()
    assert channel.read_ahead()  # the end of the stream: recv says so
    with pytest.raises(ChannelClosed):
        channel.recv()
    channel.close()


def test_blocking_channel_send_round_trips_to_async_channel() -> None:
    async def main() -> list[tuple[int, bytes]]:
        ours, theirs = socket.socketpair()
        received: list[tuple[int, bytes]] = []
        done = asyncio.get_running_loop().create_future()

        def on_frame(msg: m.WorkerToServer, payload: memoryview) -> None:
            assert isinstance(msg, m.InferDone)
            received.append((msg.rid, bytes(payload)))
            if len(received) == len(SIZES):
                done.set_result(None)

        def on_unreadable(bad: codec.UnreadableFrame) -> None:
            raise AssertionError(f"a frame could not be read: {bad}")

        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(
            lambda: AsyncChannel(codec.to_server, on_frame, lambda exc: None, on_unreadable),
            sock=ours,
        )
        sender = BlockingChannel(theirs, codec.to_worker)
        for rid, size in enumerate(SIZES):
            await loop.run_in_executor(
                None, sender.send, m.InferDone(rid=rid), [_payload(size, rid)]
            )
        await asyncio.wait_for(done, 30)
        sender.close()
        return received

    received = asyncio.run(main())
    assert received == [(rid, _payload(size, rid)) for rid, size in enumerate(SIZES)]


def test_every_message_is_in_its_direction_s_union() -> None:
    """A message missing from its union would be undecodable: the other side would drop
    the connection. Tags below 100 go to the worker, the others to the server."""
    import typing

    to_worker = set(typing.get_args(m.ServerToWorker))
    to_server = set(typing.get_args(m.WorkerToServer))
    for message in m._Msg.__subclasses__():
        tag = message.__struct_config__.tag
        assert isinstance(tag, int)
        assert message in (to_worker if tag < 100 else to_server), message.__name__


def _raw_frame(header: object, payload: bytes = b"") -> bytes:
    """A frame whose header is ``header`` as msgpack, whatever the message types say."""
    encoded = header if isinstance(header, bytes) else msgspec.msgpack.encode(header)
    return codec.PREFIX.pack(len(encoded), len(payload)) + encoded + payload


def _wire(kind: type[m._Msg], **values: object) -> list[object]:
    """``kind``'s array-like header holding ``values`` (whatever their types), its other
    fields at their defaults."""
    return [kind.__struct_config__.tag,
            *(values[f.name] if f.name in values else _default(f)
              for f in msgspec.structs.fields(kind))]  # fmt: skip


def _default(field: msgspec.structs.FieldInfo) -> object:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    return field.default_factory()


def _good(rid: int) -> bytes:
    return b"".join(bytes(b) for b in codec.encode(_ok(rid), [b"pay"]))


def _ok(rid: int) -> m.Infer:
    return m.Infer(rid=rid, request_id="ok", inputs=[])


_BYTES_ID = _wire(m.Infer, rid=41, request_id=b"bytes id", inputs=[])

# An Infer whose request id is bytes (a str field), one of an unknown tag, and bytes that
# are not msgpack at all: the first is told by its kind and rid, the others by nothing.
BAD_FRAMES = [
    (_raw_frame(_BYTES_ID, b"xyz"), m.Infer, 41, b"xyz"),
    (_raw_frame([99, 42], b"q"), None, None, b"q"),
    (_raw_frame(b"\xc1\xc1", b""), None, None, b""),
]


@pytest.mark.parametrize(
    ("frame", "kind", "ident", "payload"), BAD_FRAMES, ids=["bytes-id", "unknown-tag", "garbage"]
)
def test_blocking_channel_reads_on_after_an_unreadable_frame(
    frame: bytes, kind: type | None, ident: int | None, payload: bytes
) -> None:
    ours, theirs = socket.socketpair()
    channel = BlockingChannel(theirs, codec.to_worker)
    stream = _good(1) + frame + _good(2) + b"".join(_frames()[8:10])
    writer = threading.Thread(target=ours.sendall, args=(stream,))
    writer.start()
    assert channel.recv()[0] == _ok(1)
    with pytest.raises(codec.UnreadableFrame) as raised:
        channel.recv()
    bad = raised.value
    assert (bad.kind, bad.ident, bytes(bad.payload)) == (kind, ident, payload)
    assert channel.recv()[0] == _ok(2)
    for rid in (8, 9):  # large frames after it (read straight into their own buffers)
        msg, data = channel.recv()
        assert isinstance(msg, m.Infer) and msg.rid == rid
        assert bytes(data) == _payload(SIZES[rid], rid)
    writer.join()
    ours.close()
    channel.close()


def test_an_unreadable_reply_keeps_what_can_be_read_of_it() -> None:
    """Its request id, its fields that hold their types, and where each output's bytes
    are, even that of an output whose name is bytes (its memory can go back)."""
    header = [103, 7, [[b"OUT", "FP32", [2], 2, 4096, 8], ["ok", "FP32", [1], 0, 0, 4]],
              "", "", None, {"k": [1]}]  # fmt: skip
    with pytest.raises(codec.UnreadableFrame) as raised:
        codec.to_server.decode(msgspec.msgpack.encode(header))
    bad = raised.value
    assert bad.kind is m.InferDone and bad.ident == 7
    assert "Expected `str`, got `bytes`" in bad.cause
    first, second = bad.fields["outputs"]
    assert (first.name, first.where, first.offset, first.nbytes) == ("", m.Where.OUTPUT_ARENA,
                                                                    4096, 8)  # fmt: skip
    assert second == m.TensorRef("ok", "FP32", [1], m.Where.PAYLOAD, 0, 4)
    assert "parameters" not in bad.fields  # a list is no parameter value


def test_async_channel_reports_an_unreadable_frame_and_reads_on() -> None:
    async def main() -> tuple[list[int], list[codec.UnreadableFrame], bool]:
        ours, theirs = socket.socketpair()
        rids: list[int] = []
        bad: list[codec.UnreadableFrame] = []
        lost: list[Exception | None] = []
        done = asyncio.get_running_loop().create_future()

        def on_frame(msg: m.WorkerToServer, payload: memoryview) -> None:
            assert isinstance(msg, m.InferDone)
            rids.append(msg.rid)
            if msg.rid == 3:
                done.set_result(None)

        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(
            lambda: AsyncChannel(codec.to_server, on_frame, lost.append, bad.append), sock=ours
        )
        bytes_name = _wire(m.BlsCall, call=9, model_name=b"model", inputs=[])
        frames = [codec.encode(m.InferDone(1)), [_raw_frame(bytes_name, b"in")],
                  [_raw_frame(b"\xc1")], codec.encode(m.InferDone(3))]  # fmt: skip
        stream = b"".join(bytes(piece) for frame in frames for piece in frame)
        await loop.sock_sendall(theirs, stream)
        await asyncio.wait_for(done, 30)
        theirs.close()
        return rids, bad, bool(lost)

    rids, bad, lost = asyncio.run(main())
    assert rids == [1, 3] and not lost
    assert [(b.kind, b.ident, bytes(b.payload)) for b in bad] == [(m.BlsCall, 9, b"in"),
                                                                  (None, None, b"")]  # fmt: skip


def test_async_channel_reads_large_frames_among_small_ones() -> None:
    """Frames larger than the receive buffer (256 KiB), readable or not, arrive whole
    between small ones, all sent in one stream: the frame after a large one is read from
    its first byte."""
    large = [3 << 20, (1 << 20) + 1, 300_000]

    def payload(size: int, seed: int) -> bytes:
        return (bytes(range(seed, 251)) + bytes(range(seed))) * (size // 251) + b"e" * (size % 251)

    async def main() -> tuple[list[tuple[int, bytes]], list[codec.UnreadableFrame]]:
        ours, theirs = socket.socketpair()
        received: list[tuple[int, bytes]] = []
        bad: list[codec.UnreadableFrame] = []
        done = asyncio.get_running_loop().create_future()

        def on_frame(msg: m.WorkerToServer, data: memoryview) -> None:
            assert isinstance(msg, m.InferDone)
            received.append((msg.rid, bytes(data)))
            if msg.rid == 9:
                done.set_result(None)

        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(
            lambda: AsyncChannel(codec.to_server, on_frame, lambda exc: None, bad.append),
            sock=ours,
        )
        frames = [
            [codec.encode(m.InferDone(rid), [payload(size, rid)])
             for rid, size in enumerate([7, large[0], 10, large[1], large[1]])],
            [[_raw_frame(b"\xc1", payload(large[2], 5))]],  # unreadable
            [codec.encode(m.InferDone(rid), [payload(size, rid)])
             for rid, size in [(6, large[2]), (9, 0)]],
        ]  # fmt: skip
        stream = b"".join(bytes(p) for group in frames for frame in group for p in frame)
        theirs.setblocking(False)
        await loop.sock_sendall(theirs, stream)
        await asyncio.wait_for(done, 30)
        theirs.close()
        return received, bad

    received, bad = asyncio.run(main())
    sizes = [(0, 7), (1, large[0]), (2, 10), (3, large[1]), (4, large[1]), (6, large[2]), (9, 0)]
    assert received == [(rid, payload(size, rid)) for rid, size in sizes]
    assert [(b.kind, bytes(b.payload)) for b in bad] == [(None, payload(large[2], 5))]


def test_a_frame_that_cannot_be_encoded_is_not_written() -> None:
    ours, theirs = socket.socketpair()
    sender = BlockingChannel(ours, codec.to_server)
    receiver = BlockingChannel(theirs, codec.to_server)
    with pytest.raises(codec.UnencodableFrame) as raised:
        sender.send(m.InferDone(1, error="\udc80"), [b"x"])
    assert raised.value.message == m.InferDone(1, error="\udc80")
    with pytest.raises(codec.UnencodableFrame):  # a batch: none of it is written
        sender.send_many([(m.InferDone(2), [b"y"]), (m.LoadFailed("\udc80"), ())])
    sender.send(m.InferDone(3))
    assert receiver.recv()[0] == m.InferDone(3)
    sender.close()
    receiver.close()
