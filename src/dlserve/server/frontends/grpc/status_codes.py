"""dlserve errors as gRPC status codes: one complete table, as Triton maps them.

A :class:`~dlserve.errors.DlserveError` raised while answering an RPC ends it with its
code and message (:func:`status_of`); any other exception is a bug or a foreign
failure: it is logged with its traceback and answered INTERNAL.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

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


def error_message(exc: Exception) -> str:
    """The text a client sees for a failure (a stream's ``error_message``)."""
    if isinstance(exc, DlserveError):
        return exc.message
    return str(exc) or type(exc).__name__


CANCELLED: Final = grpc.StatusCode.CANCELLED.value[0]
DEADLINE_EXCEEDED: Final = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_INTERNAL: Final = grpc.StatusCode.INTERNAL.value[0]


class RpcError(Exception):
    """Ends a call with this gRPC status: a failure of the call itself, not of a model."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(exc: Exception) -> tuple[int, str]:
    """The gRPC status (code, message) that ends a call which raised ``exc``."""
    if isinstance(exc, DlserveError):
        return STATUS_CODES[exc.code].value[0], exc.message
    if isinstance(exc, RpcError):
        return exc.code.value[0], exc.message
    log.error("gRPC call failed", exc_info=exc)
    return _INTERNAL, error_message(exc)
