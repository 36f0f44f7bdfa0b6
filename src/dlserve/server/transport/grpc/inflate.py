"""Compressed gRPC messages (gzip, deflate), inflated in turns of the event loop.

A message whose flag says "compressed" is kept as it arrived (:class:`Compressed`) until
its call takes it; :func:`inflate` then inflates it a piece at a time (``STEP`` bytes of
output at most per piece, the input fed ``FEED`` bytes at a time), yields to the event
loop once its pieces have taken a turn's time (``turns.py``), and stops as soon as the
output passes the limit: nothing is inflated whole first and checked afterwards, and a
bomb holds the loop for about a turn at a time. What cannot be inflated ends the call
INTERNAL, an encoding the server does not have UNIMPLEMENTED (grpc/doc/statuscodes.md).
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Final

from dlserve.server.transport.grpc.status import (
    INTERNAL,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    Status,
)
from dlserve.server.transport.turns import TURN_S, clock

STEP: Final = 1 << 16  # output bytes per piece: tens of microseconds of zlib
FEED: Final = 1 << 14  # input bytes given to zlib at once (its unconsumed tail is a copy)
TOO_LARGE: Final = "Received message larger than max ({} vs. {})"
_WBITS: Final = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class Compressed:
    """A message as it arrived, compressed; its length is its size on the wire."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)


def supported(encoding: str) -> bool:
    return encoding in _WBITS


async def inflate(encoding: str, message: memoryview, limit: int) -> bytearray | Status:
    """The message inflated, or the status its call ends with."""
    wbits = _WBITS.get(encoding)
    if wbits is None:
        return UNIMPLEMENTED, f"Compression algorithm '{encoding}' is not supported"
    inflater = zlib.decompressobj(wbits)
    out = bytearray()
    pos = 0
    turn_end = clock() + TURN_S
    try:
        while not inflater.eof:
            source: bytes | memoryview = inflater.unconsumed_tail
            if not source:
                source = message[pos : pos + FEED]
                pos += len(source)
                if not source:
                    return INTERNAL, "cannot decompress the message: it ends too soon"
            piece = inflater.decompress(source, STEP)
            out += piece
            if len(out) > limit:
                return RESOURCE_EXHAUSTED, TOO_LARGE.format(len(out), limit)
            if not inflater.eof and clock() >= turn_end:
                await asyncio.sleep(0)  # the rest of the server runs between turns
                turn_end = clock() + TURN_S
    except zlib.error as exc:
        return INTERNAL, f"cannot decompress the message: {exc}"
    return out
