"""A small HTTP/1.1 server for ASGI apps, on asyncio (or uvloop) and httptools.

It replaces uvicorn, with less server CPU per request and one write per response
(docs/benchmarks.md). What makes it cheaper:

- one Task per request and nothing else: no queue, no Event; ``receive`` only creates a
  future when it really has to wait;
- a small request (Content-Length up to 64 KiB) starts its app once the whole body is
  in, so the first ``receive`` returns it without suspending;
- response headers are held until the first body message, so a response sent as start
  + final body leaves in one ``transport.write`` (one syscall, one TCP segment);
- no per-request logging, clock reads or regex checks: the Date header is remade once a
  second, a header's CR/LF check is two ``bytes.count`` over all of them.

What it keeps: keep-alive, pipelining answered in order, request bodies streamed to the
app with flow control (reading pauses above ``exchange.HIGH_WATER`` buffered bytes),
chunked bodies both ways, HEAD, ``Expect: 100-continue``, ``http.disconnect``, and a body
the app answered early (say a 400 on its Content-Length) discarded as it arrives, so the
connection stays usable. The per-connection protocol is ``connection.py``; the
request/response cycle ``exchange.py``. A listener that cannot start raises
``ListenError``.

What it bounds (``limits.py``, docs/network-edge.md): the number of connections (more are
refused with a 503, ``transport/refusal.py``), how long a request's head and body may take
to arrive, how long a keep-alive connection may idle, and how long a client may leave a
response unread. One timer, the sweep, checks every connection's deadline a few times a
second (and remakes the Date header once a second), closing at most a few dozen a turn
of the loop.
"""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate

from dlserve.server.transport.http1.connection import Connection
from dlserve.server.transport.http1.exchange import App
from dlserve.server.transport.http1.limits import Http1Limits
from dlserve.server.transport.listen_error import ListenError
from dlserve.server.transport.refusal import Refusal
from dlserve.server.transport.timing import NEVER, Timing

_CANCEL_GRACE_S = 1.0  # how long cancelled apps get to unwind when stop() runs out of time
# connections the sweep closes (or answers 408) per turn of the loop: 2,000 drip-fed ones
# come due together, and answering all in one turn held the loop up to 9 ms at a time
_EXPIRE_PER_TURN = 64
_REFUSAL_TEXT = b'{"error":"the server has too many connections (--http-max-connections)"}'
_REFUSAL = b"".join((
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: ",
    str(len(_REFUSAL_TEXT)).encode(), b"\r\nconnection: close\r\nretry-after: 1\r\n\r\n",
    _REFUSAL_TEXT,
))  # fmt: skip


class HttpServer:
    """Serves ``app`` on ``host:port`` inside the running event loop."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        *,
        max_header_size: int = 64 * 1024,
        server_header: bool = False,
        timing: Timing = NEVER,
        limits: Http1Limits | None = None,
    ) -> None:
        self.app = app
        self.limits = limits = limits or Http1Limits()
        self._sweep_interval = limits.sweep_interval()
        never = float("inf")  # each timeout in seconds; inf: none
        self.header_s = never if limits.header_timeout is None else limits.header_timeout
        self.body_s = never if limits.body_timeout is None else limits.body_timeout
        self.idle_s = never if limits.idle_timeout is None else limits.idle_timeout
        self.send_s = never if limits.send_timeout is None else limits.send_timeout
        self.min_body_bytes = 0 if self.body_s == never else limits.body_min_rate * self.body_s
        self.timing = timing  # tracing on: requests note when their headers arrived
        self.host = host
        self.port = port
        self.max_header_size = max_header_size
        self._server_line = b"server: dlserve\r\n" if server_header else b""
        self._server: asyncio.Server | None = None
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._drained: asyncio.Future[None] | None = None
        self.stopping = False
        self.common_headers = b""  # Date and Server, ready to write
        self._clock: asyncio.TimerHandle | None = None
        self._second = -1
        self.now = 0.0  # the loop's time at the last sweep: deadlines are set from it

    def _accept(self, loop: asyncio.AbstractEventLoop) -> asyncio.Protocol:
        """A new connection, or its refusal when the listener is full."""
        limit = self.limits.max_connections
        if limit is not None and len(self.connections) >= limit:
            return Refusal(_REFUSAL)
        return Connection(self, loop)

    async def start(self) -> int:
        """Listen; the bound port (``port`` 0 picks a free one)."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: self._accept(loop),
                self.host,
                self.port,
                reuse_address=True,
                backlog=1024,
            )
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ListenError(
                f"cannot listen for HTTP on {self.host}:{self.port}: {reason}"
            ) from None
        self._tick()
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, timeout: float) -> None:
        """1. stop accepting  2. close idle connections; busy ones close after their
        response  3. after ``timeout``, close the rest and cancel their apps."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()  # 1.
        self.stopping = True
        for connection in list(self.connections):  # 2.
            connection.shutdown()
        await self._drain(timeout)
        for connection in list(self.connections):  # 3.
            connection.abort()
        for task in list(self.tasks):
            task.cancel()
        await self._drain(_CANCEL_GRACE_S)
        await server.wait_closed()
        if self._clock is not None:
            self._clock.cancel()

    async def _drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` for every connection to close and every app to return."""
        if self.connections or self.tasks:
            self._drained = asyncio.get_running_loop().create_future()
            await asyncio.wait([self._drained], timeout=timeout)

    @property
    def buffered_bytes(self) -> int:
        """Request body bytes received and not yet taken by an app, over all connections."""
        return sum(connection.buffered for connection in self.connections)

    @property
    def reading_paused(self) -> bool:
        """Whether some connection has stopped reading (its app is behind, or pipelining)."""
        return any(connection.paused for connection in self.connections)

    def _tick(self) -> None:
        """The sweep: close the connections past their deadlines; remake the Date header
        (and Server) each second, not each response."""
        wall = time.time()
        if int(wall) != self._second:
            self._second = int(wall)
            date = formatdate(wall, usegmt=True).encode()
            self.common_headers = b"date: " + date + b"\r\n" + self._server_line
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.sweep(now)
        next_second = 1.0 - wall % 1.0 + 0.01  # just past it: a timer may fire a little early
        delay = min(next_second, self._sweep_interval)
        self._clock = loop.call_at(now + delay, self._tick)

    def sweep(self, now: float) -> None:
        """Close (or answer and close) each connection whose deadline is past ``now``, at
        most ``_EXPIRE_PER_TURN`` a turn of the loop."""
        self.now = now
        due = [c for c in self.connections if c.deadline <= now or c.write_deadline <= now]
        self._expire(due, now)

    def _expire(self, due: list[Connection], now: float) -> None:
        for connection in due[:_EXPIRE_PER_TURN]:
            # one of a later turn may have closed, or moved its deadline, meanwhile
            if connection in self.connections and (
                connection.deadline <= now or connection.write_deadline <= now
            ):
                connection.expire(now)
        if len(due) > _EXPIRE_PER_TURN:
            asyncio.get_running_loop().call_soon(self._expire, due[_EXPIRE_PER_TURN:], now)

    def check_drained(self) -> None:
        drained = self._drained
        if drained is not None and not self.connections and not self.tasks and not drained.done():
            drained.set_result(None)
