"""A callee's side of direct BLS calls, driven frame by frame: a real ``serve()`` in a
thread, the test playing the server (its channel, and the descriptor socket that hands the
worker a caller's connection) and the caller (the other end of that connection).

- a request on a direct connection is answered on it, not on the server's channel, and a
  large output is lent as a PEER_ARENA ref of the arena the server announced;
- lent output-arena space stays taken until the caller gives it back, on the connection
  or in its next Infer; a caller whose connection closes gives back everything it held;
- the worker's serve loop takes requests from the server and from a direct caller in turn;
- at Shutdown the worker says goodbye on its connections.

Each runs with a worker that sleeps while it waits and with one that polls.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel
from dlserve.tensors.arena import ShmSegment
from dlserve.worker.main import install_pb_utils, serve

LARGE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            size = 32 * 1024 if x[0] >= 0 else 1  # 128 KiB: in the output arena, lent
            out = np.full(size, x[0], dtype=np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
"""
_names = itertools.count()
DEADLINE_S = 30.0
ARENA_IDS = [501, 502]  # what the server would announce: the worker's (input, output) arenas


class Peers:
    """The server's ends (channel, descriptor socket) and the callers' connections."""

    def __init__(self, sock: socket.socket, fds: socket.socket, outputs: ShmSegment) -> None:
        self.channel: BlockingChannel[m.WorkerToServer] = BlockingChannel(sock, codec.to_server)
        self.fds = fds
        self.outputs = outputs
        self.connections: list[BlockingChannel[m.WorkerToServer]] = []

    def load(self, model_file: Path) -> None:
        config = {"name": "large", "input": [], "output": []}
        self.channel.send(
            m.Load(
                model_name="large", model_version=1, repository=str(model_file.parents[2]),
                model_path=str(model_file.parents[1]), model_file=str(model_file),
                config_json=json.dumps(config), instance_name="large_0", instance_kind="CPU",
                device_id=0,
            )
        )  # fmt: skip
        assert isinstance(self.channel.recv()[0], m.Loaded)

    def connect(self) -> BlockingChannel[m.WorkerToServer]:
        """A caller's connection, handed over as the server hands it (closed at the end)."""
        ours, theirs = socket.socketpair()
        ours.settimeout(DEADLINE_S)  # a worker that died fails the test instead of hanging it
        socket.send_fds(self.fds, [b"d"], [theirs.fileno()])
        self.channel.send(m.DirectAccept(ARENA_IDS, ["/in", "/out"]))
        theirs.close()
        conn: BlockingChannel[m.WorkerToServer] = BlockingChannel(ours, codec.to_server)
        self.connections.append(conn)
        return conn


@pytest.fixture(params=[0, 1_000_000], ids=["sleeping", "polling"])
def peers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Peers]:
    """A worker that sleeps while it waits for a frame, or one that polls 1 ms first
    (--busy-poll-us 1000: it reads the server's channel and its callers' in turn)."""
    name = f"dlserve_direct_test_{next(_names)}"
    arena = ShmSegment.anonymous(f"{name}_in", 4 << 20)
    outputs = ShmSegment.anonymous(f"{name}_out", 4 << 20)
    assert arena.fd is not None and outputs.fd is not None
    theirs_arenas = (
        ShmSegment.from_fd(os.dup(arena.fd), arena.name),
        ShmSegment.from_fd(os.dup(outputs.fd), outputs.name),
    )
    ours, theirs = socket.socketpair()
    fds_ours, fds_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    install_pb_utils()
    channel = BlockingChannel(theirs, codec.to_worker, spin_ns=request.param)
    thread = threading.Thread(target=serve, args=(channel, theirs_arenas, fds_theirs),
                              daemon=True)  # fmt: skip
    thread.start()
    model_file = tmp_path / "large" / "1" / "model.py"
    model_file.parent.mkdir(parents=True)
    model_file.write_text(LARGE_MODEL)
    running = Peers(ours, fds_ours, outputs)
    try:
        running.load(model_file)
        yield running
    finally:
        ours.close()
        thread.join(timeout=30)
        for conn in running.connections:
            conn.close()
        for closing in (theirs, fds_ours, fds_theirs, arena, outputs):
            closing.close()


def call(
    conn: BlockingChannel[m.WorkerToServer], value: float, release: list[int] | None = None
) -> m.TensorRef:
    """One direct request; the output's ref, checked against the bytes it names."""
    data = np.array([value], dtype=np.float32)
    ref = m.TensorRef("INPUT0", "FP32", [1], m.Where.PAYLOAD, 0, 4)
    infer = m.Infer(rid=-1, inputs=[ref], outputs=["OUTPUT0"], release=release or [], lend=True)
    conn.send(infer, [data.data])
    done, _ = conn.recv()
    assert isinstance(done, m.InferDone) and not done.error, done
    (out,) = done.outputs
    return out


def value_at(peers: Peers, ref: m.TensorRef) -> float:
    view = peers.outputs.buffer[ref.offset : ref.offset + ref.nbytes]
    return float(np.frombuffer(view, np.float32)[-1])


def test_a_direct_request_is_answered_on_its_connection_with_lent_outputs(peers: Peers) -> None:
    conn = peers.connect()
    out = call(conn, 3.0)
    assert (out.where, out.region, out.key) == (m.Where.PEER_ARENA, ARENA_IDS[1], "/out")
    assert value_at(peers, out) == 3.0
    peers.channel.send(m.Shutdown())
    assert isinstance(peers.channel.recv()[0], m.Closed)  # nothing else came to the server
    assert isinstance(conn.recv()[0], m.DirectBye)  # the worker stopped: goodbye


def test_lent_space_stays_taken_until_the_caller_gives_it_back(peers: Peers) -> None:
    conn = peers.connect()
    first = call(conn, 1.0)
    second = call(conn, 2.0)
    assert second.offset != first.offset  # the first is still the caller's
    assert value_at(peers, first) == 1.0
    conn.send(m.Release([first.offset]))
    third = call(conn, 3.0, release=[second.offset])  # given back in the request itself
    assert third.offset == first.offset
    fourth = call(conn, 4.0)
    assert fourth.offset == second.offset


def test_a_caller_that_goes_gives_back_what_it_held(peers: Peers) -> None:
    conn = peers.connect()
    held = [call(conn, float(i)).offset for i in range(3)]
    assert len(set(held)) == 3
    small = call(conn, -1.0, release=[held[1]])  # given back in a request, none lent now
    assert small.where == m.Where.PAYLOAD
    conn.close()  # the caller died: the rest goes back, the second not twice
    other = peers.connect()
    assert call(other, 9.0).offset == min(held)
    assert value_at(peers, call(other, 10.0)) == 10.0  # and the worker serves on


def test_requests_from_the_server_and_a_direct_caller_are_served_in_turn(peers: Peers) -> None:
    conn = peers.connect()
    assert value_at(peers, call(conn, 5.0)) == 5.0
    data = np.array([6.0], dtype=np.float32)
    ref = m.TensorRef("INPUT0", "FP32", [1], m.Where.PAYLOAD, 0, 4)
    peers.channel.send(m.Infer(rid=7, inputs=[ref], outputs=["OUTPUT0"]), [data.data])
    done, _ = peers.channel.recv()
    assert isinstance(done, m.InferDone) and done.rid == 7
    assert done.outputs[0].where == m.Where.OUTPUT_ARENA  # the server's: not lent
    assert value_at(peers, call(conn, 8.0)) == 8.0
