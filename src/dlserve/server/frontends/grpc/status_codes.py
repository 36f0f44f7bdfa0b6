"""dlserve errors as gRPC status codes: one complete table, as Triton maps them.

A :class:`~dlserve.errors.DlserveError` raised while answering an RPC ends it with its
code and message (:func:`status_of`, which the gRPC server is given); anything else is
left to the transport's own mapping (a call's own ``RpcError`` keeps its status; any other
exception is a bug or a foreign failure, logged with its traceback and answered INTERNAL).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import grpc

from dlserve.errors import DlserveError, ErrorCode
from dlserve.server.transport.grpc import status

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


def error_message(exc: Exception) -> str:
    """The text a client sees for a failure (a stream's ``error_message``)."""
    if isinstance(exc, DlserveError):
        return exc.message
    return str(exc) or type(exc).__name__


def status_of(exc: Exception) -> status.Status:
    """The gRPC status (code, message) that ends a call which raised ``exc``."""
    if isinstance(exc, DlserveError):
        return STATUS_CODES[exc.code].value[0], exc.message
    return status.status_of(exc)
