"""One request and its response: the ASGI app's ``receive`` and ``send``.

``receive`` hands out the body bytes its connection has buffered, all at once, and
waits (on a future made only then) when there are none yet. ``send`` holds the
response head until the first body message, so that start + a final body leave in one
write; the head says Content-Length when the app gave it or when the whole body is
known, else the body goes chunked (HTTP/1.1) or ends with the connection (HTTP/1.0).
A body larger than ``SLICE`` leaves in slices of the app's buffer (memoryviews: never
copied whole), and after each slice ``send`` waits while the transport's buffer is past
its high-water mark: one large response neither holds the event loop in one long write
nor makes the server hold more than a slice of it in the transport's buffer.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlserve.server.transport.http1.connection import Connection

log = logging.getLogger("dlserve.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

HIGH_WATER = 1 << 20  # buffered request body bytes above which a connection stops reading
_JOIN_LIMIT = 64 * 1024  # a body up to this size is joined to its head: one bytes, one write
SLICE = 4 << 20  # a body larger than this leaves in slices this large, waiting on the client
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_INTERNAL_ERROR = (
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: 21\r\n"
    b"connection: close\r\n\r\nInternal Server Error"
)


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        raise RuntimeError(f"invalid HTTP status {status!r}")
    return line


# Set in a request's scope by an app whose work should stop when its client goes away (the
# infer endpoint): closing the connection, even half-closing it, cancels the app's task.
CANCEL_ON_CLOSE = "dlserve.cancel_on_close"
RECEIVED_NS = "dlserve.received_ns"  # in the scope while tracing is on: headers' arrival


class Exchange:
    """A request's state, from its headers to the end of its response."""

    # defaults as class attributes: a request sets only what it changes
    deferred = False  # waits for its whole body before its app starts
    arrived = False  # its app runs, or waits in the pipeline
    request_complete = False  # the parser has seen the end of the body
    body_taken = False  # the app has had the last of it (more_body False)
    waiter: asyncio.Future[None] | None = None
    disconnected = False
    task: asyncio.Task[None] | None = None
    started = False  # http.response.start received
    status = 200
    headers: Iterable[tuple[bytes, bytes]] = ()
    head_written = False
    response_complete = False
    bodiless = False  # HEAD, 1xx, 204, 304
    chunked = False
    remaining: int | None = None  # of the response's Content-Length

    def __init__(
        self, connection: Connection, scope: Scope, keep_alive: bool, expects_continue: bool
    ) -> None:
        self.connection = connection
        self.scope = scope
        self.keep_alive = keep_alive
        self.expects_continue = expects_continue  # and no 100 Continue sent yet
        self.chunks: list[bytes] = []  # body received, not yet taken by the app

    def start(self, app: App) -> None:
        """Run ``app`` for this request: its one Task."""
        connection = self.connection
        self.task = task = connection.loop.create_task(self.run(app))
        connection.server.tasks.add(task)

    async def run(self, app: App) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:  # stop() ran out of time, or the app gave up
            self._fail()
            raise
        except Exception:
            log.exception("HTTP app failed on %s %s", self.scope["method"], self.scope["path"])
            self._fail()
        else:
            if not self.response_complete and not self.disconnected:
                what = "completing its response" if self.head_written else "a response"
                log.error("HTTP app returned without %s on %s", what, self.scope["path"])
                self._fail()
        finally:
            server = self.connection.server
            server.tasks.discard(self.task)
            self.task = None  # a cancelled task's traceback holds this exchange: no cycle
            if server.stopping:
                server.check_drained()

    def _fail(self) -> None:
        """A 500 if nothing was written yet, else close: the response is cut short."""
        if self.response_complete or self.disconnected:
            return
        if self.head_written:
            self.connection.close()
            return
        self.keep_alive = False
        self.connection.write(_INTERNAL_ERROR)
        self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        if self.waiter is not None:
            self.wake()
        self.connection.response_done(self)

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def disconnect(self) -> None:
        self.disconnected = True
        self.wake()
        task = self.task
        if task is not None and not self.response_complete and self.scope.get(CANCEL_ON_CLOSE):
            task.cancel()  # nobody will read the answer: stop the work queued for it

    # --- receive ----------------------------------------------------------------------------

    async def receive(self) -> Message:
        if self.expects_continue:
            self.expects_continue = False
            if not self.started and not self.request_complete:
                self.connection.write(_CONTINUE)
        while not (self.disconnected or self.response_complete):
            chunks = self.chunks
            if chunks or (self.request_complete and not self.body_taken):
                body = chunks.pop() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                more = not self.request_complete
                self.body_taken = not more
                if body:
                    connection = self.connection
                    connection.buffered -= len(body)
                    if connection.paused:
                        connection.update_reading()
                return {"type": "http.request", "body": body, "more_body": more}
            waiter = self.waiter = self.connection.loop.create_future()
            try:
                await waiter
            finally:
                self.waiter = None
        return {"type": "http.disconnect"}

    # --- send -------------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        connection = self.connection
        if connection.write_paused and not self.disconnected:
            await connection.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if kind == "http.response.body" and self.started and not self.response_complete:
            body = message.get("body", b"")
            more = message.get("more_body", False)
            size = len(body) if type(body) is bytes else memoryview(body).nbytes
            if size > SLICE:
                await self._write_sliced(memoryview(body), size, more)
                if self.disconnected:
                    return
            else:
                self._write(body, size, more)
            if not more:
                if self.remaining:
                    connection.close()
                    raise RuntimeError("response body shorter than its Content-Length")
                self._complete()
        elif kind == "http.response.start" and not self.started:
            self.started = True
            self.status = message["status"]
            self.headers = message.get("headers", ())
        else:
            state = "completed" if self.response_complete else "started" if self.started else "new"
            raise RuntimeError(f"unexpected ASGI message {kind!r} for a {state} response")

    def _write(self, body: bytes | memoryview, size: int, more: bool) -> None:
        """One write: the head (before the first body), the body, its framing."""
        parts: list[bytes | memoryview] = []
        if not self.head_written:
            parts.append(self._head(None if more else size))
        if self.bodiless:
            pass
        elif self.chunked:
            if size:
                parts += (b"%x\r\n" % size, body, b"\r\n")
            if not more:
                parts.append(b"0\r\n\r\n")
        else:
            if self.remaining is not None:
                self.remaining -= size
                if self.remaining < 0:
                    raise RuntimeError("response body longer than its Content-Length")
            parts.append(body)
        self.head_written = True
        transport = self.connection.transport
        if transport is None or transport.is_closing():
            return
        if size > _JOIN_LIMIT:
            transport.writelines(parts)
        else:
            transport.write(b"".join(parts))

    async def _write_sliced(self, view: memoryview, size: int, more: bool) -> None:
        """A large body: its head and framing, then slices, each written once the client
        has read enough of the one before (resume_writing), and never two in one turn of
        the loop: a client that reads as fast as the socket takes them would otherwise
        hold the loop for the whole body."""
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        head = b"" if self.head_written else self._head(None if more else size)
        self.head_written = True
        suffix = b""
        if self.bodiless:
            return
        if self.chunked:
            head += b"%x\r\n" % size
            suffix = b"\r\n" if more else b"\r\n0\r\n\r\n"
        elif self.remaining is not None:
            self.remaining -= size
            if self.remaining < 0:
                raise RuntimeError("response body longer than its Content-Length")
        connection = self.connection
        connection.write(head)
        for offset in range(0, size, SLICE):
            if connection.write_paused:
                await connection.drain()
            elif offset:
                await asyncio.sleep(0)  # the loop's other work between two slices
            if self.disconnected:
                return
            connection.write(view[offset : offset + SLICE])
        connection.write(suffix)

    def _head(self, size: int | None) -> bytes:
        """Status line and headers; sets how the body is framed. ``size``: the whole
        body's, when the app gives it in one message."""
        block, length, chunked, says_close = self._app_headers()
        scope, status = self.scope, self.status
        lines = [_STATUS_LINES.get(status) or status_line(status), block]
        self.bodiless = scope["method"] == "HEAD" or status < 200 or status in (204, 304)
        connection = self.connection
        close = not self.keep_alive or says_close or connection.closing or connection.eof
        close = close or (self.expects_continue and not self.request_complete)  # body unsent
        if self.bodiless:
            pass  # whatever the headers say, no body follows
        elif chunked:
            self.chunked = True
        elif length is not None:
            self.remaining = length
        elif size is not None:
            lines.append(b"content-length: %d\r\n" % size)
            self.remaining = size
        elif scope["http_version"] == "1.1":
            lines.append(b"transfer-encoding: chunked\r\n")
            self.chunked = True
        else:
            close = True  # HTTP/1.0: the body ends with the connection
        if close:
            self.keep_alive = False
            if not says_close:
                lines.append(b"connection: close\r\n")
        elif scope["http_version"] == "1.0":
            lines.append(b"connection: keep-alive\r\n")
        lines += (connection.server.common_headers, b"\r\n")
        return b"".join(lines)

    def _app_headers(self) -> tuple[bytes, int | None, bool, bool]:
        """The app's headers as one block, its Content-Length, whether it asked for
        chunked framing, whether it said Connection: close."""
        parts: list[bytes] = []
        length: int | None = None
        chunked = says_close = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = True
            elif lower == b"connection":
                says_close = b"close" in value.lower()
            parts += (name, b": ", value, b"\r\n")
        block = b"".join(parts)
        lines = len(parts) // 4  # no CR or LF inside a name or a value: no header injection
        if block.count(b"\n") != lines or block.count(b"\r") != lines:
            raise RuntimeError("invalid character in an HTTP response header")
        return block, length, chunked, says_close
