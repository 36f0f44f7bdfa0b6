"""dlserve's one error hierarchy.

Every failure that reaches a client is a :class:`DlserveError` carrying an
:class:`ErrorCode`. Each frontend maps the code once (``server/frontends/grpc/status_codes.py``,
``server/frontends/http/status_codes.py``); nothing here knows about a protocol.

::

    DlserveError                      request-scoped: the request fails, the server goes on
     +-- InvalidArgumentError          bad input from the client (shape, dtype, JSON ...)
     +-- NotFoundError                 unknown model, version, input, region
     +-- AlreadyExistsError            a region name that is taken
     +-- UnavailableError              model not ready, queue full, worker restarting
     +-- WorkerDiedError               the instance's process died while the request was in it
     +-- UnsupportedError              a feature this server does not offer
     |    +-- DecoupledModelError      a one-response endpoint asked of a decoupled model
     +-- ModelError                    the model raised, or returned an error response
     +-- DeadlineExceededError         a wait ran past its deadline
     +-- CancelledError                the client went away
     +-- InternalError                 a bug or a foreign failure translated at a seam
    FatalError                        the server cannot go on (not a DlserveError)
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Triton's error kinds (TRITONSERVER_Error_Code) plus deadline."""

    UNKNOWN = "unknown"
    INTERNAL = "internal"
    NOT_FOUND = "not_found"
    INVALID_ARG = "invalid_arg"
    UNAVAILABLE = "unavailable"
    UNSUPPORTED = "unsupported"
    ALREADY_EXISTS = "already_exists"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"


class DlserveError(Exception):
    """A request-scoped failure with a code and a message meant for the client."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgumentError(DlserveError):
    code = ErrorCode.INVALID_ARG


class NotFoundError(DlserveError):
    code = ErrorCode.NOT_FOUND


class AlreadyExistsError(DlserveError):
    code = ErrorCode.ALREADY_EXISTS


class UnavailableError(DlserveError):
    code = ErrorCode.UNAVAILABLE


class WorkerDiedError(DlserveError):
    """INTERNAL, as Triton answers for a stub process that died (its message: see
    :func:`not_healthy`)."""

    code = ErrorCode.INTERNAL


def not_healthy(instance: str, ending: str = "") -> str:
    """Triton's words for a model instance whose process is gone, which its tests look for;
    ``ending``: how the process ended ("exited with code 1"), when known."""
    text = f"Stub process '{instance}' is not healthy."
    return f"{text} Its process {ending}." if ending else text


class UnsupportedError(DlserveError):
    code = ErrorCode.UNSUPPORTED


class DecoupledModelError(UnsupportedError):
    """A decoupled model was asked for through an endpoint that carries one response.

    Each frontend words it as Triton does for that endpoint.
    """


class ModelError(DlserveError):
    """The model's own error; ``code`` may be any the model chose (pb_utils.TritonError)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


class DeadlineExceededError(DlserveError):
    code = ErrorCode.DEADLINE_EXCEEDED


class CancelledError(DlserveError):
    code = ErrorCode.CANCELLED


class InternalError(DlserveError):
    code = ErrorCode.INTERNAL


class FatalError(Exception):
    """The server cannot continue (bad command line, port taken, ...)."""


def error_from_worker(message: str, code: str) -> DlserveError:
    """Rebuild an error a worker sent (its message, and its code as on the wire; none:
    INTERNAL)."""
    return ModelError(message, ErrorCode(code) if code else ErrorCode.INTERNAL)
