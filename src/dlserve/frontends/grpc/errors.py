"""dlserve errors as gRPC status codes: one complete table, as Triton maps them.

A :class:`~dlserve.errors.DlserveError` raised while answering an RPC becomes
``context.abort(code, message)``; any other exception is a bug or a foreign
failure: it is logged with its traceback and answered INTERNAL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, TypeVar

import grpc

from dlserve.errors import DlserveError, ErrorCode

log = logging.getLogger("dlserve.grpc")

STATUS_CODES: Final[Mapping[ErrorCode, grpc.StatusCode]] = MappingProxyType({
    ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
})  # fmt: skip


def status_code(code: ErrorCode) -> grpc.StatusCode:
    return STATUS_CODES[code]


def error_message(exc: Exception) -> str:
    """The text a client sees for a failure (a stream's ``error_message``)."""
    if isinstance(exc, DlserveError):
        return exc.message
    return str(exc) or type(exc).__name__


S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[S, Req, Any], Awaitable[Resp]]


def grpc_errors(method: Handler[S, Req, Resp]) -> Handler[S, Req, Resp]:
    """Wrap a unary RPC method so that every failure ends as a gRPC status.

    try/except costs nothing on the success path, unlike a context manager
    entered on every call.
    """

    @functools.wraps(method)
    async def wrapper(self: S, request: Req, context: Any) -> Resp:
        try:
            return await method(self, request, context)
        except DlserveError as exc:
            await context.abort(STATUS_CODES[exc.code], exc.message)
            raise  # abort raises; this only satisfies the type checker
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("gRPC %s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, error_message(exc))
            raise

    return wrapper
