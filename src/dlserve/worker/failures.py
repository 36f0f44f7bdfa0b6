"""A model's failures in the words Triton's Python backend uses, which clients match on.

Triton's stub reports a Python exception as pybind11 formats it: ``<Type>: <message>``,
then ``At:`` and the Python frames from where it was raised up to the call the stub made,
innermost first (``  <file>(<line>): <function>``); a SyntaxError without frames. The
failure of an ``execute`` call starts with "Failed to process the request(s) for model
'<instance>', message: ". dlserve's own frames are left out: where they are, Triton runs
C++, whose checks (a decoupled execute that returns responses, ...) give their bare text.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import traceback

import dlserve
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError, TritonModelException, unchecked_error

_DLSERVE = os.path.dirname(dlserve.__file__) + os.sep  # its frames stand for Triton's C++
_ASYNCIO = os.path.dirname(asyncio.__file__) + os.sep  # how dlserve runs an async execute
# the frames importlib adds above a module's import that Triton's C++ import does not
_IMPORT_ENTRY = frozenset(
    {(importlib.__file__, "import_module"), ("<frozen importlib._bootstrap>", "_gcd_import")}
)


def describe_exception(exc: BaseException) -> str:
    """``exc`` as Triton's stub describes a Python exception."""
    kind = type(exc).__name__
    if isinstance(exc, SyntaxError):
        return f"{kind}: {exc}"
    frames = _model_frames(exc)
    if not frames and isinstance(exc, TritonError | TritonModelException):
        return str(exc)  # raised by dlserve itself, as Triton's C++ throws it
    text = f"{kind}: {exc}"
    if frames:
        lines = (f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
        text += "\n\nAt:\n" + "".join(lines)
    return text


def describe_error(exc: BaseException) -> tuple[str, str]:
    """The message and ErrorCode value a client sees for the model's failure."""
    if isinstance(exc, TritonError):
        return exc.message(), exc.error_code().value
    return describe_exception(exc), "internal"


def error_reply(rid: int, exc: BaseException) -> m.InferDone:
    """Request ``rid``'s reply when ``exc`` answers it."""
    message, code = describe_error(exc)
    return m.InferDone(rid=rid, error=message, error_code=code)


def execute_failure(instance: str, exc: BaseException) -> TritonError:
    """What every request of an ``execute`` call that raised gets: Triton's message naming
    the instance, INTERNAL (a TritonError raised as such keeps its code)."""
    if isinstance(exc, TritonError):
        text, code = exc.message(), exc.code()
    else:
        text, code = describe_exception(exc), TritonError.INTERNAL
    message = f"Failed to process the request(s) for model '{instance}', message: {text}"
    return unchecked_error(message, code)


def _model_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The traceback's frames less those dlserve (and asyncio, importlib) put above the
    model's code, and less dlserve's below it (pb_utils, which is C++ in Triton)."""
    frames = traceback.extract_tb(exc.__traceback__)
    start = 0
    while start < len(frames) and _entry(frames[start]):
        start += 1
    end = len(frames)
    while end > start and frames[end - 1].filename.startswith(_DLSERVE):
        end -= 1
    return list(frames[start:end])


def _entry(frame: traceback.FrameSummary) -> bool:
    return (
        frame.filename.startswith((_DLSERVE, _ASYNCIO))
        or (frame.filename, frame.name) in _IMPORT_ENTRY
    )
