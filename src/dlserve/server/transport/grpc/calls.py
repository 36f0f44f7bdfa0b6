"""A gRPC call's parts (``rpc.py`` runs them): the method table's entries, what a handler
may ask about its call, a call's state, and the small codecs of gRPC's headers (status
trailers, timeouts, peers). A method's entry carries what is its server's own: the
handler, its message codecs, and a ``Guard`` its calls' headers must pass."""

from __future__ import annotations

import asyncio
import base64
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from dlserve.server.transport.grpc.status import Status
from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.hpack_codec import Headers

if TYPE_CHECKING:
    from dlserve.server.transport.grpc.budget import SendBudget
    from dlserve.server.transport.timing import Traced

_TIMEOUT_UNITS: Final = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_NOT_METADATA: Final = frozenset(
    ("content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding")
)
_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
END: Final = object()  # the client has sent its last message

Parts = tuple[list[bytes | memoryview], int]  # a message as pieces, and its size
Unary = Callable[[Any, "Context"], Awaitable[Any]]
Streaming = Callable[[AsyncIterator[Any], "Context"], AsyncIterator[Any]]
# a condition on a call's headers, checked before its handler runs (say, that a header
# carries a key): None lets the call in, a status refuses it
Guard = Callable[[Headers], Status | None]
# a look at a message while it arrives in pieces, called with its buffer and how much of
# it is in; one is made for each uncompressed message that arrives in pieces. What it
# raises refuses the message before the rest is gathered (the rest is dropped): it ends a
# unary call (as the handler's failure would); a streaming handler gets it as ``Refused``
# in the message's place
Screen = Callable[[memoryview, int], None]


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: its handler, and how its messages become objects and back (None: bytes)."""

    handler: Unary | Streaming
    streaming: bool = False
    deserialize: Callable[[memoryview], Any] | None = None
    serialize: Callable[[Any], bytes] | None = None
    guard: Guard | None = None
    screen: Callable[[], Screen] | None = None


class Refused:
    """A streaming call's message that its method's screen refused as it arrived: what the
    screen raised (nothing of the message is kept)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __len__(self) -> int:  # what it holds of the call's inbox: the rest is dropped
        return 0


class Context:
    """What a handler may ask about its call (the part of grpc.aio's context it needs)."""

    __slots__ = ("_budget", "_headers", "_peer", "_peer_pid", "_pending", "opened_ns", "trace")

    def __init__(
        self, peer: str, headers: Headers, peer_pid: int | None, budget: SendBudget | None = None
    ) -> None:  # fmt: skip
        self._peer = peer
        self._headers = headers
        self._peer_pid = peer_pid
        self._budget = budget  # the connection's (budget.py): a stream's work counts there
        self._pending = 0  # of the budget's ``pending``: this call's (-1: the call ended)
        self.opened_ns = 0  # when the call opened; taken only while tracing is on
        self.trace: Traced | None = None  # the call's trace: its sending is stamped

    def peer(self) -> str:
        """As gRPC writes it: "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path"."""
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The call's custom headers (``-bin`` ones decoded), made when asked for."""
        return tuple(
            (k, base64.b64decode(v + "==") if k.endswith("-bin") else v)
            for k, v in self._headers
            if not k.startswith(":") and k not in _NOT_METADATA
        )

    def peer_pid(self) -> int | None:
        """The process at the other end of a Unix-socket connection (SO_PEERCRED)."""
        return self._peer_pid

    # a streaming handler's work per message, counted as the connection's calls are
    def may_start(self) -> bool:
        """Whether one more piece of work may start now (the connection's send budget)."""
        return self._budget is None or self._budget.admits()

    async def wait_to_start(self) -> None:
        if self._budget is not None:
            await self._budget.wait()

    def started(self) -> None:
        if self._budget is not None:
            self._budget.running += 1

    def ended(self) -> None:
        if self._budget is not None:
            self._budget.running -= 1
            self._budget.moved()

    def holding(self, size: int) -> None:
        """The handler holds ``size`` more bytes of responses (fewer, when negative) that
        it has not yet handed to the call (its outbox): they count as the connection's
        unsent bytes until they are handed over or the call ends."""
        if self._budget is not None and self._pending >= 0:
            self._pending += size
            self._budget.pending += size

    def release(self) -> None:
        """The call ended: what its handler held no longer counts (nor will from now)."""
        if self._budget is not None and self._pending > 0:
            self._budget.pending -= self._pending
        self._pending = -1


class Call:
    __slots__ = ("buffer", "context", "deadline", "encoding", "filled", "inbox", "inbox_bytes",
                 "message", "method", "remote_ended", "screen", "skip", "started",
                 "stream_id", "task", "waiter")  # fmt: skip

    def __init__(self, stream_id: int, method: Method, context: Context, encoding: str) -> None:
        self.stream_id = stream_id
        self.method = method
        self.context = context
        self.encoding = encoding
        self.buffer = bytearray()  # the 5-byte prefix of a message, arriving in pieces
        self.message: memoryview | None = None  # a message arriving in pieces (prefix first)
        self.filled = 0  # bytes of ``message`` arrived
        self.screen: Screen | None = None  # the method's look at ``message`` as it arrives
        self.skip = 0  # bytes still to come of a message the screen refused: dropped
        self.inbox: deque[Any] = deque()  # whole messages (and END) not yet taken
        self.inbox_bytes = 0
        self.waiter: asyncio.Future[None] | None = None  # a streaming handler waiting
        self.remote_ended = False
        self.started = False  # response headers sent
        self.task: asyncio.Task[None] | None = None
        self.deadline: asyncio.TimerHandle | None = None


def _percent_encode(text: str) -> bytes:
    return b"".join(
        bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        for b in text.encode("utf-8", "replace")
    )


def trailers(code: int, message: str) -> bytes:
    fields = [(b"grpc-status", str(code).encode())]
    if message:
        fields.append((b"grpc-message", _percent_encode(message)))
    return hpack_codec.encode(fields)


def peer_pid_of(transport: asyncio.BaseTransport) -> int | None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return None
    pid = int(_PEERCRED.unpack(credentials)[0])
    return pid if pid > 0 else None


def peer_name_of(transport: asyncio.BaseTransport) -> str:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        return f"unix:{transport.get_extra_info('sockname') or ''}"
    peer = transport.get_extra_info("peername")
    if not peer:
        return ""
    if sock is not None and sock.family == socket.AF_INET6:
        return f"ipv6:[{peer[0]}]:{peer[1]}"
    return f"ipv4:{peer[0]}:{peer[1]}"


def parse_timeout(text: str) -> float | None:
    unit = _TIMEOUT_UNITS.get(text[-1:])
    if unit is None or not text[:-1].isdigit():
        return None
    return int(text[:-1]) * unit
