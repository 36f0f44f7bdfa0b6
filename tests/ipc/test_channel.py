"""Frames over a real socketpair: every size, split anywhere, in both channel kinds."""

from __future__ import annotations

import asyncio
import socket
import threading

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
        buffers = codec.encode(m.Infer(rid, f"r{rid}", [], []), [_payload(size, rid)])
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

        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(
            lambda: AsyncChannel(codec.to_server, on_frame, lambda exc: None), sock=ours
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
