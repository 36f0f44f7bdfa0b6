"""What both frontends read the same way from a client's request: the model version it
names, and whether a failure happened in inference or refused the request.

A version is read as Triton reads it (``GetModelVersionFromString``): empty names the
latest ready version, anything else must be a non-negative 64-bit integer. The core also
takes "-1" for the latest (BLS requests and ensemble steps name it so); a client may not.

Triton reports a request's failure in one of two places: when it issues the request (the
model is unknown, an input is wrong, the queue is full: the request is refused) or in the
response callback (the model raised or answered with an error, its instance died). Its
streaming endpoints answer the two differently, and so do dlserve's.
"""

from __future__ import annotations

from typing import Final

from dlserve.errors import (
    CancelledError,
    DeadlineExceededError,
    DlserveError,
    InvalidArgumentError,
    ModelError,
    WorkerDiedError,
)

INT64_MAX: Final = 2**63 - 1
_SHOULD_BE: Final = "version should be an integral value > 0"
# Failures of a request its model was given; every other DlserveError refuses a request.
_INFERENCE_ERRORS: Final = (ModelError, WorkerDiedError, DeadlineExceededError, CancelledError)


def checked_version(text: str) -> str:
    """``text`` if it names a version as Triton accepts it; Triton's INVALID_ARG if not."""
    if not text or (text.isascii() and text.isdigit() and int(text) <= INT64_MAX):
        return text
    digits = text[1:]
    if text.startswith("-") and digits.isascii() and digits.isdigit() and int(text) >= -INT64_MAX:
        raise InvalidArgumentError(f"invalid model version specified '{text}' , {_SHOULD_BE}")
    raise InvalidArgumentError(
        f"failed to get model version from specified version string '{text}' (details: stol), "
        + _SHOULD_BE
    )


def of_inference(error: Exception) -> bool:
    """Whether ``error`` failed a request its model was given (anything that is not a
    DlserveError is a bug on the way to or from the model: it counts as one)."""
    return not isinstance(error, DlserveError) or isinstance(error, _INFERENCE_ERRORS)
