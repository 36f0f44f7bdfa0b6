"""gRPC over HTTP/2 (``h2/connection.py``): calls, length-prefixed messages, status,
deadlines.

One :class:`GrpcConnection` per client connection; each stream is a call of a
:class:`Method` from the server's table: unary (one message in, one out) or streaming
both ways. A unary call's handler starts when its request has arrived whole, and its
response (headers, message, trailers) leaves in one write. What gRPC over HTTP/2 says
(grpc/doc/PROTOCOL-HTTP2.md) and this keeps: ``grpc-timeout`` ends the call with
DEADLINE_EXCEEDED and cancels its handler; a client's RST_STREAM or a lost connection
cancels it; messages compressed with gzip or deflate are accepted (``inflate.py``,
within the server's ``limits``); a call that breaks the framing (a unary call of more or
fewer than one message, a stream that ends inside a message, a Compressed-Flag other than
0 or 1, or 1 on a call without ``grpc-encoding``) ends with the status grpc names for it
(UNIMPLEMENTED for the number of messages, INTERNAL for the rest); errors are
"trailers-only" responses with ``grpc-status`` and a percent-encoded ``grpc-message``.
A handler's failure becomes a status through the server's ``status_of``; a method's
``guard`` may refuse a call from its headers before its handler runs, and its ``screen``
a message arriving in pieces from its first bytes, before the rest is gathered. A run of
DATA frames inside a message (``Connection.stream_frames``) is copied into it with one
strided copy, the screen looking as after each frame.

``GrpcConnection`` subclasses the HTTP/2 ``Connection`` because it is one: an HTTP/2
connection whose streams are calls. It answers the connection's stream callbacks, which
run per frame as its own methods (no handler object to reach through on each DATA frame),
and uses the connection's public sending calls; it touches none of its state. Like the
connection, it is driven by bytes in and writes bytes out, so a test runs calls on it
without a socket (it needs an event loop: handlers are tasks).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from dlserve.server.transport.grpc.budget import SendBudget
from dlserve.server.transport.grpc.calls import (
    END,
    Call,
    Context,
    Parts,
    Refused,
    Streaming,
    Unary,
    parse_timeout,
    peer_name_of,
    peer_pid_of,
    trailers,
)
from dlserve.server.transport.grpc.inflate import TOO_LARGE, Compressed, inflate
from dlserve.server.transport.grpc.status import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    OK,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    RpcRefused,
)
from dlserve.server.transport.h2 import hpack_codec
from dlserve.server.transport.h2.connection import Connection
from dlserve.server.transport.h2.frames import END_HEADERS, HEADERS, HIGH_WATER, frame
from dlserve.server.transport.h2.hpack_codec import Headers

if TYPE_CHECKING:
    from dlserve.server.transport.grpc.listener import GrpcServer


# a client that breaks gRPC's framing (PROTOCOL-HTTP2.md's Length-Prefixed-Message)
ONE_MESSAGE: Final = "a unary call needs exactly one request message"
CUT_SHORT: Final = "the call ended inside a message: its length prefix says more than was sent"
BAD_FLAG: Final = "a message's Compressed-Flag must be 0 or 1, not {}"
NO_ENCODING: Final = "a compressed message on a call without grpc-encoding"
_HEAD_BLOCK: Final = hpack_codec.encode((
    (b":status", b"200"), (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity,deflate,gzip"),
))  # fmt: skip
_OK_TRAILERS: Final = hpack_codec.encode(((b"grpc-status", b"0"),))


class GrpcConnection(Connection):
    """One client connection of a :class:`GrpcServer`; its streams are calls."""

    def __init__(self, server: GrpcServer) -> None:
        super().__init__(server.http2)
        self.server = server
        self.calls: dict[int, Call] = {}
        self._peer = ""
        self._peer_pid: int | None = None
        self._status_of = server.status_of
        self._max_message = server.limits.max_message
        self.budget = SendBudget(server.limits, self.streams, self._buffered, self._stuck)
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._peer = peer_name_of(transport)
        self._peer_pid = peer_pid_of(transport)
        self.server.connections.add(self)
        if self.server.stopping:
            self.go_away()

    def closed(self) -> None:
        self.budget.close()
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            self._cancel(call)
        self.calls.clear()
        self.server.check_drained()

    # -- what the connection holds unsent (budget.py) ----------------------------------
    def frames_handled(self) -> None:
        self.budget.moved()  # a window may have grown, a stream been reset

    def pause_writing(self) -> None:
        self.budget.paused = True
        self.budget.watch()

    def resume_writing(self) -> None:
        self.budget.paused = False
        self.budget.moved()

    def _buffered(self) -> int:
        size = getattr(self.transport, "get_write_buffer_size", None)
        return int(size()) if size is not None else 0

    def _stuck(self) -> None:
        """Past its budget for the send timeout: dropped, unsent bytes and all (a close
        would wait for them to be written)."""
        transport = self.transport
        if transport is not None:
            getattr(transport, "abort", transport.close)()

    # -- a call begins ------------------------------------------------------------------
    def stream_opened(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        fields = dict(headers)
        method = self.server.methods.get(fields.get(":path", ""))
        if method is None or fields.get(":method") != "POST":
            path = fields.get(":path", "")
            self._refuse(stream_id, UNIMPLEMENTED, f"Method not found: {path}", end_stream)
            return
        if not fields.get("content-type", "").startswith("application/grpc"):
            self._refuse(stream_id, UNIMPLEMENTED, "not a gRPC request", end_stream)
            return
        if method.guard is not None and (refusal := method.guard(headers)) is not None:
            self._refuse(stream_id, *refusal, end_stream)
            return
        context = Context(self._peer, headers, self._peer_pid, self.budget)
        call = Call(stream_id, method, context, fields.get("grpc-encoding", "identity"))
        if self.server.timing.active:
            call.context.opened_ns = time.monotonic_ns()
        self.calls[stream_id] = call
        self.server.calls += 1
        timeout = parse_timeout(fields.get("grpc-timeout", ""))
        if timeout is not None:
            call.deadline = self._loop.call_later(timeout, self._expire, call)
        if method.streaming:
            call.task = self._loop.create_task(self._run_streaming(call))
        if end_stream:
            self.stream_data(stream_id, b"", True)

    def headers_too_large(self, stream_id: int, end_stream: bool) -> None:
        self._refuse(stream_id, RESOURCE_EXHAUSTED, "header list too large", end_stream)

    def _refuse(self, stream_id: int, code: int, message: str, end_stream: bool) -> None:
        self.send(stream_id, b"", (), self._trailers_only(code, message))
        if not end_stream:
            self.stop_reading(stream_id)

    @staticmethod
    def _trailers_only(code: int, message: str) -> bytes:
        return _HEAD_BLOCK + trailers(code, message)

    # -- messages in --------------------------------------------------------------------
    def stream_data(self, stream_id: int, data: memoryview | bytes, end_stream: bool) -> None:
        call = self.calls.get(stream_id)
        if call is None:
            return
        if (call.message is None and not call.buffer and len(data) >= 5
                and int.from_bytes(data[1:5], "big") == len(data) - 5
                and len(data) - 5 <= self._max_message):  # fmt: skip
            self._message(call, data[0], memoryview(data)[5:])  # the usual case: no copy
        elif data:
            self._gather(call, memoryview(data))
        if end_stream and self.calls.get(stream_id) is call:
            call.remote_ended = True
            if call.message is not None or call.buffer or call.skip:
                self._finish(call, INTERNAL, CUT_SHORT)
                return
            self._deliver(call, END)

    def _gather(self, call: Call, data: memoryview) -> None:
        """Messages arriving in pieces: each is copied once, into a buffer of its size made
        when its 5-byte prefix is in (no copy of what arrived before, however large)."""
        while data:
            if call.skip:  # the rest of a message the screen refused: dropped
                take = min(call.skip, len(data))
                call.skip -= take
                data = data[take:]
                continue
            message = call.message
            if message is None:
                take = min(5 - len(call.buffer), len(data))
                call.buffer += data[:take]
                data = data[take:]
                if len(call.buffer) < 5:
                    return
                size = int.from_bytes(call.buffer[1:5], "big")
                if size > self._max_message:
                    self._finish(
                        call, RESOURCE_EXHAUSTED, TOO_LARGE.format(size, self._max_message)
                    )
                    return
                # not bytearray(size): calloc's fresh pages fault on every first write
                message = call.message = np.empty(size, np.uint8).data
                call.filled = 0
                screen = call.method.screen
                call.screen = screen() if screen is not None and not call.buffer[0] else None
            take = min(len(message) - call.filled, len(data))
            message[call.filled : call.filled + take] = data[:take]
            call.filled += take
            data = data[take:]
            if not self._arrived(call, message):
                return

    def stream_frames(self, stream_id: int, frames: memoryview, length: int) -> int:
        """A run of DATA frames inside a message being gathered: their payloads copied
        into it in one strided copy, as many whole frames as it has room for (``length``
        bytes every ``9 + length``, after the first 9); the rest frame by frame. How many
        frames it took: all, unless the call ended on one of them."""
        call = self.calls.get(stream_id)
        step = 9 + length
        count = len(frames) // step
        taken = 0
        while taken < count and call is not None and self.calls.get(stream_id) is call:
            message, left = call.message, count - taken
            if call.skip >= 2 * length:  # whole frames of a message the screen refused
                took = min(left, call.skip // length)
                call.skip -= took * length
            elif message is not None and len(message) - call.filled >= 2 * length:
                took = min(left, (len(message) - call.filled) // length)
                np.ndarray((took, length), np.uint8, message, call.filled)[...] = np.ndarray(
                    (took, length), np.uint8, frames, taken * step + 9, (step, 1)
                )
                call.filled += took * length
                taken += took
                if not self._arrived(call, message, took, length):
                    break
                continue
            else:
                took = 1
                self.stream_data(stream_id, frames[taken * step + 9 : (taken + 1) * step], False)
            taken += took
        return taken if call is not None and self.calls.get(stream_id) is not call else count

    def _arrived(self, call: Call, message: memoryview, frames: int = 1, length: int = 0) -> bool:
        """Bytes of ``message`` have arrived (in ``frames`` frames of ``length`` bytes):
        its screen looks at them as each frame came in, and a whole message goes on. False
        once the call has ended."""
        if call.screen is not None:
            try:
                for later in range(frames - 1, -1, -1):
                    call.screen(message, call.filled - later * length)
            except Exception as exc:  # the message is refused: the rest is not gathered
                call.message = call.screen = None
                if not call.method.streaming:
                    self._finish(call, *self._status_of(exc))
                    return False
                call.skip = len(message) - call.filled
                call.buffer.clear()
                self._deliver(call, Refused(exc))
                return True
        if call.filled == len(message):
            flag = call.buffer[0]
            call.message = call.screen = None
            call.buffer.clear()
            self._message(call, flag, message)
            return self.calls.get(call.stream_id) is call  # or the message ended the call
        return True

    def _message(self, call: Call, flag: int, message: memoryview) -> None:
        """A whole message; a compressed one is kept so until its call takes it."""
        if flag:
            if flag != 1:
                self._finish(call, INTERNAL, BAD_FLAG.format(flag))
                return
            if call.encoding == "identity":
                self._finish(call, INTERNAL, NO_ENCODING)
                return
            self._deliver(call, Compressed(message))
            return
        self._deliver(call, message)

    def _deliver(self, call: Call, item: Any) -> None:
        if call.method.streaming:
            call.inbox.append(item)
            if item is not END:
                call.inbox_bytes += len(item)
            if call.waiter is not None and not call.waiter.done():
                call.waiter.set_result(None)
        elif item is END:
            if call.task is None:
                request = call.inbox.popleft() if call.inbox else None
                call.task = self._loop.create_task(self._run_unary(call, request))
        elif call.inbox:  # a second message: refused at once, not gathered
            self._finish(call, UNIMPLEMENTED, ONE_MESSAGE)
        else:
            call.inbox.append(item)

    async def _requests(self, call: Call) -> AsyncIterator[Any]:
        deserialize = call.method.deserialize
        while True:
            while not call.inbox:
                call.waiter = self._loop.create_future()
                await call.waiter
            item = call.inbox.popleft()
            if item is END:
                return
            call.inbox_bytes -= len(item)
            if call.inbox_bytes <= HIGH_WATER:
                self.give_back(call.stream_id)
            if type(item) is Compressed:
                item = await self._inflated(call, item)
            elif type(item) is Refused:
                yield item  # the handler's to answer; nothing to deserialize
                continue
            if self.budget.stream_waits():
                await self.budget.wait(unary=False)
            yield deserialize(item) if deserialize is not None else item

    async def _inflated(self, call: Call, item: Compressed) -> memoryview:
        """A compressed message inflated; raises RpcRefused with the status that ends
        its call when it cannot be (or is too large)."""
        inflated = await inflate(call.encoding, item.data, self.server.limits.max_inflated)
        if isinstance(inflated, tuple):
            raise RpcRefused(*inflated)
        return memoryview(inflated)

    def holding(self, stream_id: int) -> bool:
        call = self.calls.get(stream_id)
        return call is not None and call.inbox_bytes > HIGH_WATER

    # -- running a call -----------------------------------------------------------------
    async def _run_unary(self, call: Call, request: memoryview | Compressed | None) -> None:
        method = call.method
        if request is None:
            self._finish(call, UNIMPLEMENTED, ONE_MESSAGE)
            return
        budget = self.budget
        if not budget.admits():
            try:
                await budget.wait(unary=True)
            except asyncio.CancelledError:
                self._finish(call, CANCELLED, "Cancelled")
                raise
        budget.running += 1
        try:
            if isinstance(request, Compressed):
                request = await self._inflated(call, request)
            handler: Unary = method.handler  # type: ignore[assignment]
            arg = method.deserialize(request) if method.deserialize is not None else request
            response = await handler(arg, call.context)
            payload = method.serialize(response) if method.serialize is not None else response
        except asyncio.CancelledError:
            self._finish(call, CANCELLED, "Cancelled")
            self._release_trace(call.context)
            raise
        except RpcRefused as exc:
            self._finish(call, exc.code, exc.message)
        except Exception as exc:
            self._finish(call, *self._status_of(exc))
            self._release_trace(call.context)
        else:
            trace = call.context.trace
            if trace is None:
                self._respond(call, payload, _OK_TRAILERS)
                return
            trace.stamp("GRPC_SEND_START", time.monotonic_ns())
            self._respond(call, payload, _OK_TRAILERS)
            trace.stamp("GRPC_SEND_END", time.monotonic_ns())
            trace.release()
        finally:
            budget.running -= 1
            budget.moved()

    @staticmethod
    def _release_trace(context: Context) -> None:
        if context.trace is not None:
            context.trace.release()

    async def _run_streaming(self, call: Call) -> None:
        method = call.method
        handler: Streaming = method.handler  # type: ignore[assignment]
        try:
            async for response in handler(self._requests(call), call.context):
                payload = method.serialize(response) if method.serialize is not None else response
                self._respond(call, payload, None)
                await self.drained(call.stream_id)
        except asyncio.CancelledError:
            self._finish(call, CANCELLED, "Cancelled")
            raise
        except RpcRefused as exc:
            self._finish(call, exc.code, exc.message)
        except Exception as exc:
            self._finish(call, *self._status_of(exc))
        else:
            self._finish(call, OK, "")

    def _respond(self, call: Call, payload: bytes | Parts, trailers: bytes | None) -> None:
        """Send a response message (``Parts``: its pieces, not joined, and their size)."""
        head = b""
        if not call.started:
            call.started = True
            head = frame(HEADERS, END_HEADERS, call.stream_id, _HEAD_BLOCK)
        if isinstance(payload, tuple):
            pieces, size = payload
        else:
            pieces, size = [payload], len(payload)
        self.send(call.stream_id, head, [b"\x00" + size.to_bytes(4, "big"), *pieces], trailers)
        self.budget.sent(call.stream_id, size)
        if trailers is not None:
            self._done(call)

    def _finish(self, call: Call, code: int, message: str) -> None:
        """End the call with a status (nothing happens if it has ended already)."""
        if self.calls.get(call.stream_id) is not call:
            return
        block = trailers(code, message) if call.started else self._trailers_only(code, message)
        task = call.task
        self.send(call.stream_id, b"", (), block)
        self._done(call)
        if task is not None and not task.done():
            task.cancel()

    def _done(self, call: Call) -> None:
        if self.calls.pop(call.stream_id, None) is None:
            return
        # a task that ends by an exception keeps it, its traceback, the traceback's frames,
        # and so the call: the call must not keep the task, or the cycle (and the messages
        # its frames hold) waits for the garbage collector
        call.task = None
        call.context.release()
        if call.deadline is not None:
            call.deadline.cancel()
        if not call.remote_ended:
            self.stop_reading(call.stream_id)
        self.server.calls -= 1
        self.server.check_drained()

    def _expire(self, call: Call) -> None:
        self._finish(call, DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _cancel(self, call: Call) -> None:
        call.inbox.clear()  # what the client sent and the handler never took: gone now
        call.context.release()
        if call.deadline is not None:
            call.deadline.cancel()
        task, call.task = call.task, None  # no cycle through the task's exception (_done)
        if task is not None and not task.done():
            task.cancel()
        if self.calls.pop(call.stream_id, None) is not None:
            self.server.calls -= 1

    def stream_reset(self, stream_id: int) -> None:
        call = self.calls.get(stream_id)
        if call is not None:
            self._cancel(call)
            self.server.check_drained()
