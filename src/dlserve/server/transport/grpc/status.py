"""How a gRPC call ends: a status, a code and a message (grpc/doc/statuscodes.md).

A handler's failure becomes a status through a ``StatusOf`` that the server is given: the
frontends give one that knows their own errors and leaves the rest to :func:`status_of`,
the transport's, which knows only :class:`RpcError` (a failure of the call itself, with
its status) and answers anything else INTERNAL, logged with its traceback: a bug, or a
failure nobody mapped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import grpc

log = logging.getLogger("dlserve.grpc")

Status = tuple[int, str]  # a gRPC status code and its message
StatusOf = Callable[[Exception], Status]

OK: Final = 0
CANCELLED: Final = grpc.StatusCode.CANCELLED.value[0]
DEADLINE_EXCEEDED: Final = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
RESOURCE_EXHAUSTED: Final = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
UNIMPLEMENTED: Final = grpc.StatusCode.UNIMPLEMENTED.value[0]
INTERNAL: Final = grpc.StatusCode.INTERNAL.value[0]


class RpcError(Exception):
    """Ends a call with this gRPC status: a failure of the call itself, not of its work."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(exc: Exception) -> Status:
    """The status that ends a call which raised ``exc``, where nothing knows better."""
    if isinstance(exc, RpcError):
        return exc.code.value[0], exc.message
    log.error("gRPC call failed", exc_info=exc)
    return INTERNAL, str(exc) or type(exc).__name__


class RpcRefused(Exception):
    """Ends a call with this status: what the client sent breaks gRPC (a message that
    cannot be inflated, or is too large once inflated); raised where its call takes it."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
