"""BLS calls sent straight to this instance by other workers: the callee's side (the
server's is ``server/core/calls/direct_broker.py``, the caller's
``worker/bls/direct_caller.py``). The callers' connections, the wait for the next frame
on the server's channel or on any of them, and the requests that come on them, which the
serve loop runs as it runs the server's and answers on the connection they came on.

Only the serve loop reads these connections (the instance runs one ``execute`` at a time,
whoever sent the request). What this instance lends over a connection (output-arena
space, GPU outputs) is counted per connection and released when the caller gives it
back, or when the connection closes (the caller died or stopped).
"""

from __future__ import annotations

import functools
import os
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel
from dlserve.worker.bls import cuda_peers
from dlserve.worker.link import bad_frames as frames

if TYPE_CHECKING:
    from dlserve.worker.link.link import WorkerLink
    from dlserve.worker.runner import ModelRunner

Release = Callable[[list[int], list[int]], None]  # (arena offsets, GPU lend ids)


def receive_fds(sock: socket.socket | None, count: int) -> list[int]:
    """The descriptors the server sent beside a frame (one SOCK_SEQPACKET message)."""
    if sock is None or count == 0:
        return []
    _, fds, _, _ = socket.recv_fds(sock, 1, count)
    return fds


class Served:
    """A caller's connection to this instance (the callee's end)."""

    def __init__(self, sock: socket.socket, spin_ns: int) -> None:
        self.channel: BlockingChannel[m.ServerToWorker] = BlockingChannel(
            sock, codec.to_worker, spin_ns
        )
        self.lent: set[int] = set()  # output-arena offsets lent over it
        self.lent_gpu: set[int] = set()  # GPU outputs' lend ids

    def given_back(self, offsets: Sequence[int], gpu: Sequence[int] = ()) -> None:
        self.lent.difference_update(offsets)
        self.lent_gpu.difference_update(gpu)


class ServedCalls:
    """The connections of the callers that call this instance directly."""

    def __init__(self, spin_ns: int) -> None:
        self.spin_ns = spin_ns
        self.connections: list[Served] = []
        self.arena: tuple[int, str] = (0, "")  # this instance's output arena: id, path
        self.told: set[int] = set()  # client regions the server knows we mapped
        self._poll: select.poll | None = None  # over the server's channel and the connections
        self._fds: dict[int, Served | None] = {}

    def accept(self, msg: m.DirectAccept, fds: list[int]) -> None:
        """A new caller (the link's lock is held: only bookkeeping here)."""
        self.arena = (msg.arena_ids[1], msg.arena_paths[1])
        for fd in fds:
            self.connections.append(Served(socket.socket(fileno=fd), self.spin_ns))
        self._poll = None

    def lent_ref(self, conn: Served, ref: m.TensorRef) -> m.TensorRef:
        """An output of a direct call as the caller maps it: output-arena space becomes a
        PEER_ARENA ref (it is the caller's until given back)."""
        if ref.where == m.Where.OUTPUT_ARENA:
            conn.lent.add(ref.offset)
            arena, path = self.arena
            return m.TensorRef(ref.name, ref.datatype, ref.shape, m.Where.PEER_ARENA,
                               ref.offset, ref.nbytes, arena, path)  # fmt: skip
        if ref.where == m.Where.CUDA_IPC and ref.lend:
            conn.lent_gpu.add(ref.lend)
        return ref

    def lost(self, conn: Served, release: Release | None) -> None:
        """``conn`` closed (its caller died or let it go): what was lent over it goes back."""
        if conn in self.connections:
            self.connections.remove(conn)
            self._poll = None
        conn.channel.close()
        if release is not None and (conn.lent or conn.lent_gpu):
            release(sorted(conn.lent), sorted(conn.lent_gpu))
        conn.lent.clear()
        conn.lent_gpu.clear()

    def close_all(self) -> None:
        """This instance stops: each caller hears that what it has sent and not had an
        answer to was not run (so it goes through the server)."""
        for conn in self.connections:
            try:
                conn.channel.send(m.DirectBye())
            except OSError:
                pass
            conn.channel.close()
        self.connections.clear()
        self._poll = None

    # -- waiting ------------------------------------------------------------------------
    def ready(self, server: BlockingChannel[m.ServerToWorker]) -> Served | None:
        """Wait until the server's channel or a connection has bytes to read: the
        connection, or None for the server's channel (read first when both have)."""
        if self.spin_ns:
            found, source = self._spin(server)
            if found:
                return source
        elif server.buffered():
            return None
        else:
            for conn in self.connections:
                if conn.channel.buffered():
                    return conn
        poller = self._poll
        if poller is None:
            poller = self._poll = select.poll()
            self._fds = {server.fileno(): None}
            poller.register(server.fileno(), select.POLLIN)
            for conn in self.connections:
                self._fds[conn.channel.fileno()] = conn
                poller.register(conn.channel.fileno(), select.POLLIN)
        sources = [self._fds.get(fd) for fd, _ in poller.poll()]
        if None in sources:
            return None
        return sources[0]

    def _spin(self, server: BlockingChannel[m.ServerToWorker]) -> tuple[bool, Served | None]:
        """Look at each channel in turn without sleeping for up to ``spin_ns``
        (--busy-poll-us), letting whoever else is runnable on this CPU go first between
        rounds; what arrives is read as it is found (one system call, not a poll and a
        read). Whether one had bytes, and which (None: the server's)."""
        connections = self.connections
        deadline = time.perf_counter_ns() + self.spin_ns
        while True:
            if server.read_ahead():
                return True, None
            for conn in connections:
                if conn.channel.read_ahead():
                    return True, conn
            if time.perf_counter_ns() > deadline:
                return False, None
            os.sched_yield()


# -- a caller's request -------------------------------------------------------------------

_REGIONS = (m.Where.CLIENT_REGION, m.Where.CUDA_REGION)


def serve_direct(
    runner: ModelRunner, worker: WorkerLink, conn: Served, msg: m.ServerToWorker,
    payload: memoryview,
) -> None:  # fmt: skip
    """Handle one frame from a direct caller: a request (run now, answered on ``conn``) or
    outputs it gives back."""
    if type(msg) is m.Infer:
        conn.given_back(msg.release)  # the runner frees them
        done, buffers = _answer(runner, worker, conn, msg, payload)
        if done.fences:  # the model's GPU work may be done by now: the caller need not wait
            done.fences = cuda_peers.unfinished(done.fences)
        if not done.deferred:  # deferred: the response goes when the model sends it
            try:
                _reply(worker, conn, done, buffers, runner)
            except OSError:  # the caller is gone: what it was lent goes back
                worker.served.lost(conn, runner.release)
        _tell_mapped(worker, msg)
    elif isinstance(msg, m.Release):
        runner.release(msg.offsets, msg.gpu)
        conn.given_back(msg.offsets, msg.gpu)


def _reply(
    worker: WorkerLink, conn: Served, done: m.InferDone, buffers: Sequence[bytes | memoryview],
    runner: ModelRunner,
) -> None:  # fmt: skip
    """Send the answer; one that cannot be encoded goes with its text made UTF-8, else as
    the request's error (what it lent is given back first: the caller never holds it)."""
    for _ in range(2):
        try:
            conn.channel.send(done, buffers)
            return
        except codec.UnencodableFrame as failed:
            substitute = frames.sendable(failed, worker.model_name, None)
            assert isinstance(substitute, m.InferDone)
            if substitute.outputs is not done.outputs:  # an error: its outputs go back
                lent = [ref.offset for ref in done.outputs if ref.where == m.Where.PEER_ARENA]
                gpu = frames.arena_outputs(done.outputs)[1]
                conn.given_back(lent, gpu)
                runner.release(lent, gpu)
            done = substitute
    conn.channel.send(done, buffers)


def _answer(
    runner: ModelRunner, worker: WorkerLink, conn: Served, msg: m.Infer, payload: memoryview
) -> tuple[m.InferDone, Sequence[bytes | memoryview]]:
    reply = runner.infer(msg, payload, functools.partial(_send_late, runner, worker, conn))
    if reply is None:  # decoupled: the server never offers such a model for direct calls
        done = m.InferDone(msg.rid, error="a decoupled model was called directly",
                           error_code="internal")  # fmt: skip
        reply = done, []
    done, buffers = reply
    done.outputs = [worker.served.lent_ref(conn, ref) for ref in done.outputs]
    if not done.deferred:  # (not sent: they ride with a later frame)
        done.direct = worker.direct.take_records()  # its own direct calls: the caller forwards
    return done, buffers


def _send_late(
    runner: ModelRunner, worker: WorkerLink, conn: Served, done: m.InferDone,
    buffers: list[memoryview],
) -> None:  # fmt: skip
    """A response the model sent after its ``execute`` returned (from any thread of it):
    the caller, which has this connection to itself until it is answered, reads it there."""
    done.outputs = [worker.served.lent_ref(conn, ref) for ref in done.outputs]
    try:
        _reply(worker, conn, done, buffers, runner)
    except OSError:  # the caller is gone (its connection may be dropped already): ours back
        offsets = [ref.offset for ref in done.outputs if ref.where == m.Where.PEER_ARENA]
        lent = [ref.lend for ref in done.outputs if ref.where == m.Where.CUDA_IPC and ref.lend]
        conn.given_back(offsets, lent)
        runner.release(offsets, lent)


def _tell_mapped(worker: WorkerLink, msg: m.Infer) -> None:
    """The client regions this request had mapped here, the first time: the server tells
    this worker to unmap them when they go (it did not see this request)."""
    told = worker.served.told
    new = [ref.region for ref in msg.inputs if ref.where in _REGIONS and ref.region not in told]
    if new:
        told.update(new)
        worker.send(m.DirectMapped(sorted(set(new))))
