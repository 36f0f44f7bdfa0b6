"""pb_utils' arguments, taken as Triton's pybind11 bindings take them.

Where Triton's Python API takes a C++ ``std::string`` (model, tensor and output names,
request ids, log and error messages, metric names), pybind11 accepts a ``str`` that
encodes as UTF-8, or ``bytes`` / ``bytearray``; anything else (``None`` included) is a
``TypeError`` ("incompatible function arguments"). A C++ integer takes ``int`` or anything
with ``__index__`` (numpy integers), never a float, and only values its type can hold.

dlserve's names travel to the server as UTF-8 text in typed frames, so bytes are decoded
here, at the model's call, into the ``str`` a Triton model would read back from the same
call; bytes that are not UTF-8 are refused here (Triton would keep them and fail later,
where the name is used or read back). Everything a model hands over thus has the type its
frame field has before it is encoded: the server never gets a frame it cannot read.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Final

MODULE: Final = "triton_python_backend_utils"
INT64: Final = (-(2**63), 2**63 - 1)
UINT32: Final = (0, 2**32 - 1)
UINT64: Final = (0, 2**64 - 1)


class NotText(Exception):
    """The value is not one pybind11 takes as a ``std::string``."""


def text(value: object, what: str, *, message: bool = False) -> str:
    """``value`` as a C++ string argument: a ``str`` as it is, bytes decoded as UTF-8.

    Raises NotText for any other type, or a ``str`` that does not encode as UTF-8 (lone
    surrogates, which pybind11 refuses too). Bytes that are not UTF-8: a TritonModelException
    naming ``what``; for a ``message`` (log lines, error text), replacement characters."""
    if type(value) is str:  # the usual case: no copy, one look at the characters
        if value.isascii() or _encodes(value):
            return value
        raise NotText
    if isinstance(value, bytes | bytearray):  # numpy.bytes_ is a bytes
        try:
            return value.decode(errors="replace" if message else "strict")
        except UnicodeDecodeError as exc:
            from dlserve.pb_utils.exceptions import TritonModelException  # errors imports this

            raise TritonModelException(f"{what} is not valid UTF-8: {exc}") from None
    if isinstance(value, str):  # numpy.str_ and other subclasses: a plain str
        return text(str.__str__(value), what, message=message)
    raise NotText


def texts(values: object, what: str) -> list[str]:
    """A ``std::vector<std::string>`` argument: a sequence (not a string itself) of
    strings, as pybind11's list caster takes it (a numpy array is one)."""
    if type(values) is not list and type(values) is not tuple:
        is_array = type(values).__name__ == "ndarray"
        if isinstance(values, str | bytes | bytearray) or not (
            is_array or isinstance(values, Sequence)
        ):
            raise NotText
    return [text(value, what) for value in values]  # type: ignore[attr-defined]


def integer(value: object, bounds: tuple[int, int]) -> int:
    """A C++ integer argument: an int (or anything with ``__index__``) within ``bounds``.
    Raises NotText (the argument does not convert) otherwise."""
    if type(value) is int:
        number = value
    elif isinstance(value, float) or value is None:
        raise NotText
    else:
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise NotText from None
    if not bounds[0] <= number <= bounds[1]:
        raise NotText
    return number


def flag(value: object) -> bool:
    """A C++ bool argument: True, False or None, and numbers (pybind11 converts them)."""
    if value is True or value is False:
        return value
    if value is None:
        return False
    if isinstance(value, int | float) or type(value).__module__ == "numpy":
        try:
            return bool(value)
        except (TypeError, ValueError):  # a numpy array of several values
            raise NotText from None
    raise NotText


def _encodes(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def incompatible(
    function: str, signature: str, given: Mapping[str, object] | Sequence[object]
) -> TypeError:
    """pybind11's TypeError for a call whose arguments do not convert: ``function`` as it
    names it ("__init__" for a constructor), ``signature`` as it prints the overload,
    ``given`` the arguments (a mapping: keyword arguments)."""
    kind = "constructor" if function == "__init__" else "function"
    if isinstance(given, Mapping):
        invoked = "kwargs: " + ", ".join(f"{key}={value!r}" for key, value in given.items())
    else:
        invoked = ", ".join(repr(value) for value in given)
    return TypeError(
        f"{function}(): incompatible {kind} arguments. The following argument types are "
        f"supported:\n    1. {signature}\n\nInvoked with: {invoked}"
    )
