"""The gRPC server: listens on TCP (and a Unix socket) and runs calls of a method table
(``rpc.py`` serves each connection).

TCP may be TLS (``TlsOptions``: a certificate and key, and for mutual TLS the root
clients' certificates chain to); the Unix socket, for local clients, is not. Each
connection's HTTP/2 limits, keepalive and idle timeout are the ``Limits`` given as
``http2``. The caller gives what is its own: the method table, how a handler's failure
becomes a gRPC status (``status_of``), whether tracing wants a call's arrival time
(``timing``), and the ``limits`` on what one peer may make it hold (``limits.py``). A listener
that cannot start raises ``ListenError``.

At most ``max_connections`` connections are open at once (TCP and Unix socket together);
one more is refused (``refusal.py``): its first call fails with UNAVAILABLE and a message
that says why, then GOAWAY. (A refusal at the HTTP/2 level alone, GOAWAY before any
stream, makes gRPC clients retry on and on without telling the caller.)

``stop`` is a graceful shutdown as gRPC servers do it: GOAWAY to every client (no new
calls), the calls in flight finish, then connections close; after ``timeout`` the rest
are cancelled.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from dlserve.server.transport.grpc.calls import Method
from dlserve.server.transport.grpc.limits import DEFAULT_LIMITS, GrpcLimits
from dlserve.server.transport.grpc.refusal import GrpcRefusal
from dlserve.server.transport.grpc.rpc import GrpcConnection
from dlserve.server.transport.grpc.status import StatusOf, status_of
from dlserve.server.transport.h2.limits import Limits
from dlserve.server.transport.listen_error import ListenError
from dlserve.server.transport.timing import NEVER, Timing

_CANCEL_GRACE_S = 1.0  # how long cancelled calls get to unwind when stop() runs out of time


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """gRPC over TLS: the server's certificate and key, and for mutual TLS the root
    certificate that clients' certificates must chain to."""

    server_cert: str
    server_key: str
    root_cert: str | None = None
    mutual: bool = False

    def context(self) -> ssl.SSLContext:
        if self.mutual and self.root_cert is None:
            raise ListenError("cannot set up TLS for gRPC: mutual TLS needs a root certificate")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.set_alpn_protocols(["h2"])  # gRPC clients insist on it
        try:
            context.load_cert_chain(self.server_cert, self.server_key)
            if self.mutual and self.root_cert is not None:
                context.load_verify_locations(self.root_cert)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as exc:
            raise ListenError(f"cannot set up TLS for gRPC: {exc}") from None
        return context


class GrpcServer:
    max_connections: int | None = None  # set before start(); more are refused

    def __init__(
        self, methods: Mapping[str, Method], host: str, port: int, uds_path: str | None = None,
        tls: TlsOptions | None = None, timing: Timing = NEVER, status_of: StatusOf = status_of,
        limits: GrpcLimits = DEFAULT_LIMITS, http2: Limits = Limits(),  # noqa: B008 (frozen)
    ) -> None:  # fmt: skip
        self.methods = methods  # by path: "/inference.GRPCInferenceService/ModelInfer"
        self.limits = limits  # what one peer may make the server hold (limits.py)
        self.timing = timing  # tracing on: calls note when they opened
        self.status_of = status_of  # how a handler's failure ends its call
        self.host = host
        self.port = port
        self.uds_path = uds_path
        self.tls = tls
        self.http2 = http2  # what each HTTP/2 connection allows its client
        self.connections: set[GrpcConnection] = set()
        self.calls = 0  # in flight
        self.stopping = False
        self._servers: list[asyncio.Server] = []
        self._drained: asyncio.Future[None] | None = None

    async def start(self) -> int:
        """Listen; the bound TCP port (``port`` 0 picks a free one)."""
        loop = asyncio.get_running_loop()
        context = self.tls.context() if self.tls is not None else None
        try:
            server = await loop.create_server(
                self._accept, self.host, self.port, reuse_address=True,
                backlog=1024, ssl=context,
            )  # fmt: skip
        except OSError as exc:
            address = f"{self.host}:{self.port}"
            raise ListenError(
                f"cannot listen for gRPC on {address}: {exc.strerror or exc}"
            ) from None
        self._servers.append(server)
        for sock in server.sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.uds_path is not None:
            _remove_stale_socket(self.uds_path)
            try:
                unix = await loop.create_unix_server(self._accept, self.uds_path)
            except OSError as exc:
                await self.stop(0)
                where = f"unix:{self.uds_path}"
                raise ListenError(
                    f"cannot listen for gRPC on {where}: {exc.strerror or exc}"
                ) from None
            self._servers.append(unix)
        return int(server.sockets[0].getsockname()[1])

    def _accept(self) -> asyncio.Protocol:
        """A new connection, or its refusal when the server holds ``max_connections``."""
        limit = self.max_connections
        if limit is not None and len(self.connections) >= limit:
            return GrpcRefusal()
        return GrpcConnection(self)

    async def stop(self, timeout: float | None) -> None:
        """1. stop accepting  2. GOAWAY: no new calls  3. wait up to ``timeout`` for the
        calls in flight  4. close every connection, cancelling what is left."""
        servers, self._servers = self._servers, []
        self.stopping = True
        for server in servers:  # 1.
            server.close()
        for connection in list(self.connections):  # 2.
            connection.go_away()
        await self._drain(timeout or 0)  # 3.
        for connection in list(self.connections):  # 4.
            connection.abort()
        await self._drain(_CANCEL_GRACE_S)
        for server in servers:
            await server.wait_closed()
        if self.uds_path is not None and servers:
            _remove_stale_socket(self.uds_path)

    async def _drain(self, timeout: float) -> None:
        if self.calls and timeout > 0:
            self._drained = asyncio.get_running_loop().create_future()
            await asyncio.wait([self._drained], timeout=timeout)

    def check_drained(self) -> None:
        drained = self._drained
        if drained is not None and not self.calls and not drained.done():
            drained.set_result(None)


def _remove_stale_socket(path: str) -> None:
    """A socket file left by a server that died is removed; anything else is an error."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ListenError(f"cannot listen for gRPC on unix:{path}: not a socket")
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens there
    else:
        raise ListenError(f"cannot listen for gRPC on unix:{path}: another server listens there")
    finally:
        probe.close()
