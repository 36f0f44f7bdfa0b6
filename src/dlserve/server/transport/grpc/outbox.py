"""The response messages of one streaming call on their way to its connection, bounded.

The connection (``rpc.py``) stops taking a call's messages while more than 4 MiB wait for
a slow reader; where several producers answer one call (the frontends' ModelStreamInfer
runs a task per request of the stream), an unbounded queue between them and the call
would grow instead. Producers wait while ``limit`` bytes are queued, so they stop taking
work from upstream, whose own flow control then holds back what feeds it.

A producer that has its message waits holding it; so that a stream of small requests
with large responses does not start many that would all wait so, :meth:`Outbox.admit`
lets one more start only while what is queued and each running one, counted at the size
of the largest recent message (a sixteenth of the limit until one is seen: 16 may start
before the first message), fit the limit (one always may when none runs).

What waits in an outbox is produced and not yet sent: ``holding`` (the call's
``Context.holding``) tells the connection, whose send budget counts it with the
responses that wait in its streams' queues (``budget.py``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Final

from dlserve.server.transport.grpc.calls import Parts

OUTBOX_BYTES: Final = 4 * 1024 * 1024
FIRST_PRODUCERS: Final = 16  # may start before the first message: a batch's worth


class Outbox:
    """A queue of serialized messages bounded by their bytes (one message beyond); ``None``
    ends the call. A message is bytes or ``Parts`` (its pieces, not joined, and their
    size). Small notices (an error, the end) go in without waiting."""

    def __init__(
        self, limit: int = OUTBOX_BYTES, holding: Callable[[int], None] | None = None
    ) -> None:
        self._holding = holding  # told of the bytes queued as they change (its call's)
        self._items: deque[bytes | Parts | None] = deque()
        self._bytes = 0
        self._limit = limit
        self._ready = asyncio.Event()  # something is queued
        self._room = asyncio.Event()  # fewer than limit bytes are queued
        self._room.set()
        # of recent messages; until one is seen a guess that lets FIRST_PRODUCERS start
        self._largest = limit // FIRST_PRODUCERS
        self._guess = True

    async def put(self, message: bytes | Parts) -> None:
        """Queue ``message`` once fewer than ``limit`` bytes wait."""
        while self._bytes >= self._limit:
            self._room.clear()
            await self._room.wait()
        self.put_nowait(message)

    def put_nowait(self, message: bytes | Parts | None) -> None:
        self._items.append(message)
        if message is not None:
            size = _size(message)
            self._bytes += size
            if self._holding is not None:
                self._holding(size)
            # a larger message counts at once, smaller ones wear it down by an eighth each
            largest = self._largest
            self._largest = size if self._guess else max(size, largest - (largest >> 3))
            self._guess = False
        self._ready.set()

    def crowded(self, running: int) -> bool:
        """Whether one more producer must wait to start, ``running`` running already."""
        return bool(running) and self._bytes + (running + 1) * self._largest > self._limit

    async def admit(self, running: Callable[[], int]) -> None:
        """Wait until one more producer may start, ``running()`` running already."""
        while self.crowded(running()):
            self._room.clear()
            await self._room.wait()

    def finished(self) -> None:
        """A producer is done: one waiting in :meth:`admit` looks again."""
        self._room.set()

    async def get(self) -> bytes | Parts | None:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        message = self._items.popleft()
        if message is not None:
            size = _size(message)
            self._bytes -= size
            if self._holding is not None:
                self._holding(-size)
            if self._bytes < self._limit:
                self._room.set()
        return message


def _size(message: bytes | Parts) -> int:
    return message[1] if isinstance(message, tuple) else len(message)
