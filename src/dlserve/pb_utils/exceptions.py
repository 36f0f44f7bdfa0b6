"""Triton's model-side error types: ``pb_utils.TritonError`` and ``TritonModelException``.

``TritonError`` is what a model puts in ``InferenceResponse(error=...)``; its code
(Triton's ``TRITONSERVER_Error_Code`` values) reaches the client as the matching
gRPC / HTTP status. ``TritonModelException`` is what pb_utils raises (and what
models raise) for a failure inside the model.
"""

from __future__ import annotations

from typing import ClassVar, Final

from dlserve.errors import ErrorCode
from dlserve.pb_utils import arguments

_ERROR_SIGNATURE: Final = (
    f"{arguments.MODULE}.TritonError(message: str, code: {arguments.MODULE}.TritonError."
    "__ErrorCode = <__ErrorCode.INTERNAL: 1>)"
)


class TritonError(Exception):
    """An error a model returns in an InferenceResponse (raising one works too)."""

    UNKNOWN: ClassVar[int] = 0
    INTERNAL: ClassVar[int] = 1
    NOT_FOUND: ClassVar[int] = 2
    INVALID_ARG: ClassVar[int] = 3
    UNAVAILABLE: ClassVar[int] = 4
    UNSUPPORTED: ClassVar[int] = 5
    ALREADY_EXISTS: ClassVar[int] = 6
    CANCELLED: ClassVar[int] = 7

    def __init__(self, message: str | bytes, code: int = 1) -> None:
        try:
            message = arguments.text(message, "TritonError's message", message=True)
            if isinstance(code, bool) or not isinstance(code, int) or code not in _CODES:
                raise arguments.NotText
        except arguments.NotText:
            raise arguments.incompatible(
                "__init__", _ERROR_SIGNATURE, {"message": message, "code": code}
            ) from None
        super().__init__(message)
        self._message = message
        self._code = int(code)

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def error_code(self) -> ErrorCode:
        """The core's ErrorCode for this error's code."""
        return _CODES[self._code]

    def __str__(self) -> str:
        return self._message


def unchecked_error(message: str, code: int = TritonError.INTERNAL) -> TritonError:
    """A TritonError that dlserve makes itself, around text a model gave (an exception's,
    which may hold anything): not checked as a model's arguments are; the frame that
    carries it makes its text sendable."""
    error = TritonError.__new__(TritonError)
    Exception.__init__(error, message)
    error._message, error._code = message, code
    return error


_CODES: dict[int, ErrorCode] = {
    TritonError.UNKNOWN: ErrorCode.UNKNOWN,
    TritonError.INTERNAL: ErrorCode.INTERNAL,
    TritonError.NOT_FOUND: ErrorCode.NOT_FOUND,
    TritonError.INVALID_ARG: ErrorCode.INVALID_ARG,
    TritonError.UNAVAILABLE: ErrorCode.UNAVAILABLE,
    TritonError.UNSUPPORTED: ErrorCode.UNSUPPORTED,
    TritonError.ALREADY_EXISTS: ErrorCode.ALREADY_EXISTS,
    TritonError.CANCELLED: ErrorCode.CANCELLED,
}


class TritonModelException(Exception):
    """Raised by models (and by pb_utils) for a failure inside the model. Any object is a
    message, as for any exception (Triton's is a plain Python exception): ``str()`` of it."""

    def __init__(self, message: object = "") -> None:
        super().__init__(message)
        self._message = str(message)

    def message(self) -> str:
        return self._message

    def __str__(self) -> str:
        return self._message
