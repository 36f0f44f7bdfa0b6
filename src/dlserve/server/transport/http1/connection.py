"""One HTTP/1.1 connection: parses requests with httptools and runs their exchanges.

Three roles for an exchange (``exchange.py``): the one the parser is filling
(``parsing``), the one whose app runs and whose response is being written (``active``),
and pipelined ones parsed meanwhile, answered in order (``queue``). Reading pauses while
a request waits in the queue or while more than ``HIGH_WATER`` body bytes wait for an app.
The next request's app does not start while the transport's write buffer is past its
high-water mark (the client is not reading): a connection holds at most one response that
its client has not taken, and one request parsed ahead.

Its timeouts (``limits.py``) are one deadline and the phase it belongs to: the head
(from the connection's start or the request's first byte), the body (each window must
bring a minimum of bytes while reading is not paused), idle between requests; and a
second deadline while writing is paused (the send timeout). The listener's sweep calls
``expire`` once a deadline is past.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

import httptools

from dlserve.server.transport.http1.exchange import (
    CANCEL_ON_CLOSE,
    HIGH_WATER,
    RECEIVED_NS,
    Exchange,
    status_line,
)

if TYPE_CHECKING:
    from dlserve.server.transport.http1.listener import HttpServer

log = logging.getLogger("dlserve.http")

_DEFER_LIMIT = 64 * 1024  # a body up to this size is read whole before its app starts
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"expect"))
_ASGI = {"version": "3.0"}


# the phase a connection's deadline belongs to
_NONE = 0  # an app runs, or waits for the client to read: no deadline of the client's
_HEAD = 1  # a request's head is awaited
_BODY = 2  # a request's body is read
_IDLE = 3  # keep-alive: between requests
_NEVER = math.inf
_HEAD_TIMEOUT = b"the request's head did not arrive in time (--http-header-timeout)"
_BODY_TIMEOUT = b"the request's body arrived too slowly (--http-body-timeout)"


class _HeadTooLarge(Exception):
    """The request line and headers are longer than ``max_header_size``."""


class Connection(asyncio.Protocol):
    __slots__ = (
        "active", "app", "buffered", "chunked", "client", "closing", "content_length",
        "deadline", "drain_waiter", "eof", "error", "expect", "head_size", "header_bytes",
        "headers", "in_headers", "local", "loop", "parser", "parsing", "paused", "phase",
        "queue", "received", "server", "transport", "upgraded", "url", "write_deadline",
        "write_paused",
    )  # fmt: skip

    def __init__(self, server: HttpServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.app = server.app
        self.loop = loop
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.parsing: Exchange | None = None
        self.active: Exchange | None = None
        self.queue: deque[Exchange] = deque()
        self.buffered = 0  # body bytes received, not yet taken by an app
        self.paused = False
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.closing = False  # the server is stopping: close after the in-flight response
        self.eof = False  # the client has half-closed: close after the responses
        self.upgraded = False  # an Upgrade/CONNECT request: nothing after it is HTTP/1.1
        self.error: bytes | None = None  # a 400 to send once the in-flight responses are out
        self.in_headers = True
        self.header_bytes = 0
        self.phase = _HEAD  # the first head is due from the connection's start
        self.deadline = server.now + server.header_s
        self.write_deadline = _NEVER
        self.received = 0  # body bytes in the current window of the body timeout
        self._new_message()
        server.connections.add(self)  # now, not in connection_made: the listener's count
        # of connections holds those accepted in the same turn of the loop

    def _new_message(self) -> None:
        self.url = b""
        self.head_size = 0  # of the header names and values
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length = 0
        self.chunked = False
        self.expect = False

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport = transport
        self.client = _address(transport.get_extra_info("peername"))
        self.local = _address(transport.get_extra_info("sockname"))
        sock = transport.get_extra_info("socket")
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass  # not TCP

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for exchange in (self.active, self.parsing, *self.queue):
            if exchange is not None:
                exchange.disconnect()
        self.queue.clear()
        self.buffered = 0
        self._wake_writer()
        self.server.check_drained()

    def eof_received(self) -> bool | None:
        if self.active is None or self.parsing is not None:
            return None  # idle, or a request cut short: close
        if self.active.scope.get(CANCEL_ON_CLOSE):
            return None  # a client that stops sending gives up such a request: close
        self.eof = True  # complete requests in flight: answer them, then close
        return True

    def pause_writing(self) -> None:
        self.write_paused = True
        self.write_deadline = self.server.now + self.server.send_s

    def resume_writing(self) -> None:
        self.write_paused = False
        self.write_deadline = _NEVER
        self._wake_writer()
        if self.active is None and self.queue:
            self._next()

    def _wake_writer(self) -> None:
        waiter, self.drain_waiter = self.drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        if self.drain_waiter is None or self.drain_waiter.done():
            self.drain_waiter = self.loop.create_future()
        await self.drain_waiter

    def data_received(self, data: bytes) -> None:
        if self.error is not None or self.upgraded:
            return
        if self.in_headers:
            self.header_bytes += len(data)
        if self.phase == _IDLE:  # a request's first bytes: its head is due
            self.phase = _HEAD
            self.deadline = self.server.now + self.server.header_s
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.upgraded = True
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._fail(431, b"Request Header Fields Too Large")
            else:
                log.debug("malformed HTTP request from %s: %s", self.client, exc)
                self._fail(400, b"Bad Request")
            return
        if self.in_headers and self.header_bytes > self.server.max_header_size:
            self._fail(431, b"Request Header Fields Too Large")  # and still incomplete

    # --- httptools callbacks (on_message_begin left out: one call less per request) --------

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value)
        name = name.lower()
        self.headers.append((name, value))
        if name in _FRAMING:
            if name == b"content-length":
                self.content_length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = True
            else:
                self.expect = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        if len(self.url) + self.head_size > self.server.max_header_size:
            raise _HeadTooLarge
        parser = self.parser
        keep_alive = parser.should_keep_alive() and not parser.should_upgrade()
        exchange = Exchange(self, self._scope(parser), keep_alive, self.expect)
        if self.server.timing.active:
            exchange.scope[RECEIVED_NS] = time.monotonic_ns()
        self.parsing = exchange
        if self.chunked or self.content_length:
            self.phase = _BODY
            self.deadline = self.server.now + self.server.body_s
            self.received = 0
        else:
            self.phase = _NONE
            self.deadline = _NEVER
        if self.expect or self.chunked or self.content_length > _DEFER_LIMIT:
            self._arrive(exchange)  # the app may refuse the body before it is sent
        else:
            exchange.deferred = True
        self.in_headers = False
        self.header_bytes = self.head_size = self.content_length = 0
        self.url = b""
        self.headers = []
        self.chunked = self.expect = False

    def _scope(self, parser: httptools.HttpRequestParser) -> dict[str, Any]:
        url = self.url
        if url[:1] == b"/" and b"#" not in url:
            raw_path, _, query = url.partition(b"?")
        else:  # absolute-form, or a fragment
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        return {
            "type": "http", "asgi": _ASGI, "http_version": parser.get_http_version(),
            "method": parser.get_method().decode("ascii"), "scheme": "http", "path": path,
            "raw_path": raw_path, "query_string": query, "root_path": "", "headers": self.headers,
            "client": self.client, "server": self.local,
        }  # fmt: skip

    def on_body(self, body: bytes) -> None:
        self.received += len(body)
        exchange = self.parsing
        if exchange is None or exchange.response_complete or exchange.disconnected:
            return  # answered already: discard what still arrives
        exchange.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused:
            self.update_reading()
        if exchange.waiter is not None:
            exchange.wake()

    def on_message_complete(self) -> None:
        exchange, self.parsing = self.parsing, None
        self.in_headers = True
        self.phase = _NONE
        self.deadline = _NEVER
        if exchange is None:
            return
        exchange.request_complete = True
        if exchange.deferred:
            exchange.deferred = False
            self._arrive(exchange)
        elif exchange.waiter is not None:
            exchange.wake()

    # --- running exchanges ----------------------------------------------------------------

    def _arrive(self, exchange: Exchange) -> None:
        exchange.arrived = True
        if self.active is None and not self.write_paused:
            self.active = exchange
            exchange.start(self.app)
        else:  # behind another, or its client has not read the last response yet
            self.queue.append(exchange)
            self.update_reading()

    def response_done(self, exchange: Exchange) -> None:
        """``exchange``'s response is out: close, or go on with the next request."""
        self.active = None
        if exchange.chunks:  # a body the app did not read: drop it
            self.buffered -= sum(len(chunk) for chunk in exchange.chunks)
            exchange.chunks.clear()
        if not exchange.keep_alive or self.closing or (self.eof and not self.queue):
            self.close()
        elif self.queue:
            if not self.write_paused:  # else resume_writing starts it
                self._next()
        elif self.error is not None:
            self.write(self.error)
            self.close()
        elif self.upgraded:
            self.close()
        else:
            if self.paused:
                self.update_reading()
            self._await_next()

    def _next(self) -> None:
        """Start the app of the first request waiting in the queue."""
        self.active = self.queue.popleft()
        self.active.start(self.app)
        if not self.queue:
            self.update_reading()

    def _await_next(self) -> None:
        """Nothing runs: the idle timeout runs, or the head timeout where part of the next
        head is in."""
        if self.phase != _NONE:
            return  # the next request's body is being read: its window runs
        server = self.server
        if self.header_bytes:
            self.phase, self.deadline = _HEAD, server.now + server.header_s
        else:
            self.phase, self.deadline = _IDLE, server.now + server.idle_s

    def expire(self, now: float) -> None:
        """A deadline is past (the listener's sweep): close, or answer 408 and close."""
        server = self.server
        if self.write_deadline <= now:  # the client has not read for send_s: drop all
            log.debug("HTTP client %s does not read its response: closing", self.client)
            self.deadline = self.write_deadline = _NEVER
            self.abort()
            return
        phase = self.phase
        if phase == _BODY and (self.paused or self.received >= server.min_body_bytes):
            self.received = 0  # enough in this window (or reading is paused): the next
            self.deadline = now + server.body_s
            return
        self.phase, self.deadline = _NONE, _NEVER
        if phase == _IDLE:
            self.close()  # between requests a server may close without a word (RFC 9112 9.8)
        elif phase == _HEAD:
            self._fail(408, _HEAD_TIMEOUT)
        elif phase == _BODY:
            self._fail(408, _BODY_TIMEOUT)

    def update_reading(self) -> None:
        """Pause or resume reading: paused while a request waits in the queue, while
        more than HIGH_WATER body bytes wait for an app, or after a malformed request."""
        pause = self.buffered > HIGH_WATER or bool(self.queue) or self.error is not None
        transport = self.transport
        if pause == self.paused or transport is None or transport.is_closing():
            return
        self.paused = pause
        if pause:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def _fail(self, status: int, reason: bytes) -> None:
        """A request that cannot be parsed: answer ``status`` after the in-flight
        responses and close. A body broken while its app reads it (a bad chunk): the app
        hears a disconnect, and the client gets ``status`` if nothing of the response has
        gone yet."""
        exchange, self.parsing = self.parsing, None
        self.error = b"".join((
            status_line(status), b"content-type: text/plain\r\ncontent-length: ",
            str(len(reason)).encode(), b"\r\nconnection: close\r\n\r\n", reason,
        ))  # fmt: skip
        if exchange is not None and exchange.arrived:
            if exchange is self.active and not exchange.head_written:
                exchange.response_complete = True  # what the app sends now is dropped
                self.write(self.error)
            exchange.disconnect()
            self.close()
            return
        if self.active is None:
            self.write(self.error)
            self.close()
        else:
            self.update_reading()  # the rest is not read

    # --- used by exchanges and the server ---------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.writelines(parts)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else after the in-flight response."""
        self.closing = True
        if self.active is None:
            self.close()
        elif not self.active.head_written:
            self.active.keep_alive = False  # says so in its headers


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None
