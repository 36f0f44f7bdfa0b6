"""What one gRPC connection may make the server hold produced and not yet sent, and how
long it may stay past that: its :class:`SendBudget` (``limits.send_budget``,
``limits.send_timeout``), which its ``GrpcConnection`` owns.

What a connection holds unsent is its responses that wait for the client's flow-control
window (the HTTP/2 streams' queues), those its streaming calls' handlers have made and
not yet handed to their streams (ModelStreamInfer's outboxes: ``pending``) and the bytes
in the socket's write buffer. A client
that sends small requests with large outputs and reads nothing would make the server hold
every output; instead:

- a unary call runs only while the connection holds no more than its budget, counting
  each call already running at the size of the connection's largest recent response (a
  sixteenth of the budget until it has had one, so 16 calls may run before the first
  response): past it, further calls wait before they run;
- a streaming call is handed its next message only while the connection holds no more
  than its budget; a handler that starts a piece of work per message (ModelStreamInfer's
  requests) starts each as such a call, through its call's ``Context`` (``may_start``,
  ``wait_to_start``, ``started``, ``ended``), so a connection's streams together run no
  more than its budget allows;
- a connection whose responses wait while nothing moves for ``send_timeout`` (no frame
  from the client, the socket's buffer not drained, no call ended) is closed: its calls
  are cancelled and what it held is released. Its budget bounds what it holds meanwhile.

The common case costs a few comparisons per call: nothing is summed while no response
waits and the socket takes what is written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dlserve.server.transport.grpc.limits import GrpcLimits
from dlserve.server.transport.h2.frames import StreamState

log = logging.getLogger("dlserve.grpc")

# until a response is seen a call counts as this fraction of the budget: so many calls may
# run before the first response (a batch's worth; Triton's clients expect a few at once)
FIRST_CALLS = 16


class SendBudget:
    """One connection's account of what it holds unsent, and the calls waiting on it."""

    __slots__ = (
        "_backlog",
        "_budget",
        "_buffered",
        "_guess",
        "_largest",
        "_moved",
        "_room",
        "_stuck",
        "_timeout",
        "_waiting",
        "_watchdog",
        "paused",
        "pending",
        "running",
        "streams",
    )  # fmt: skip

    def __init__(
        self, limits: GrpcLimits, streams: dict[int, StreamState],
        buffered: Callable[[], int], stuck: Callable[[], None],
    ) -> None:  # fmt: skip
        self._budget = limits.send_budget
        self._timeout = limits.send_timeout
        self.streams = streams  # the connection's open streams (read, never changed)
        self._buffered = buffered  # bytes in the socket's write buffer
        self._stuck = stuck  # closes the connection
        self._largest = max(1, limits.send_budget // FIRST_CALLS)
        self._guess = True  # no response yet: _largest is a guess
        self._backlog: set[int] = set()  # streams whose responses wait for window
        self.paused = False  # the socket's buffer is past its high-water mark
        self.pending = 0  # bytes made by handlers, not yet handed to a stream (Context)
        self.running = 0  # unary calls running
        self._waiting = 0  # calls waiting for room
        self._room: asyncio.Event | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._moved = False  # something moved since the watchdog was armed

    # -- the calls' side ----------------------------------------------------------------
    def admits(self) -> bool:
        """Whether a unary call may run now (the quick check of the usual case)."""
        if self._backlog or self.paused or self.pending:
            return self._fits(self.held(), self.running)
        return not self.running or (self.running + 1) * self._largest <= self._budget

    def _fits(self, held: int, running: int | None) -> bool:
        if held > self._budget:
            return False
        return not running or held + (running + 1) * self._largest <= self._budget

    async def wait(self, unary: bool = True) -> None:
        """Wait until a call may run (``unary``: a unary call, or a stream's request that
        its handler starts as one), or a stream may take its next message (while what is
        held fits the budget)."""
        self._waiting += 1
        try:
            while not self._fits(self.held(), self.running if unary else None):
                self.watch()
                if self._room is None:
                    self._room = asyncio.Event()
                self._room.clear()
                await self._room.wait()
        finally:
            self._waiting -= 1

    def stream_waits(self) -> bool:
        """Whether a stream must wait before it takes its next message."""
        return bool(self._backlog or self.paused or self.pending) and self.held() > self._budget

    def sent(self, stream_id: int, size: int) -> None:
        """A response of ``size`` bytes was handed to the stream; it may wait there."""
        # the largest recent response: a larger one counts at once, smaller ones wear it
        # down by an eighth each (the first replaces the guess)
        largest = self._largest
        self._largest = size if self._guess else max(size, largest - (largest >> 3))
        self._guess = False
        stream = self.streams.get(stream_id)
        if stream is not None and stream.queued:
            self._backlog.add(stream_id)
            self.watch()

    # -- what moves it ----------------------------------------------------------------
    def held(self) -> int:
        """Bytes held unsent: the waiting responses (in the streams' queues, and those not
        yet handed to them) and the socket's buffer."""
        held = self._buffered() + self.pending
        for stream_id in list(self._backlog):
            stream = self.streams.get(stream_id)
            if stream is None or not stream.queued:
                self._backlog.discard(stream_id)
            else:
                held += stream.queued
        return held

    def moved(self) -> None:
        """Something moved (the client sent a frame: a window may have grown; the socket
        drained; a call ended): waiting calls look again, and the connection is not stuck."""
        self._moved = True
        if self._waiting and self._room is not None:
            self._room.set()

    def watch(self) -> None:
        """Responses wait: from now, a send timeout in which nothing moves closes it."""
        if self._watchdog is None and self.held():
            self._moved = False
            loop = asyncio.get_running_loop()
            self._watchdog = loop.call_later(self._timeout, self._check)

    def _check(self) -> None:
        """The send timeout passed with responses waiting: if nothing moved meanwhile (no
        frame from the client, the socket not drained, no call ended), it is closed."""
        self._watchdog = None
        held = self.held()
        if not held:
            return
        if self._moved:  # it drains, however slowly: look again later
            self.watch()
            return
        log.warning("gRPC connection closed: %d bytes unsent for %g s", held, self._timeout)
        self._stuck()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._backlog.clear()
        self.moved()
