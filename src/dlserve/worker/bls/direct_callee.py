"""BLS calls sent straight to this instance by other workers: the callee's connections,
and the wait for the next frame on the server's channel or on any of them.

Only the serve loop reads these connections (the instance runs one ``execute`` at a time,
whoever sent the request). What this instance lends over a connection (output-arena
space, GPU outputs) is counted per connection and released when the caller gives it
back, or when the connection closes (the caller died or stopped).
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable, Sequence

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel

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
