"""``pb_utils.Logger``: log lines from model code, in Triton's format, on the worker's stderr.

A line reads ``I0612 10:00:00.123456 4242 model.py:31] [model 'name'] message``: the
level letter, UTC time, the process id, the caller's file and line (as Triton
prints them) and the model the worker serves; with the log format ISO8601,
``2026-06-12T10:00:00Z I 4242 model.py:31] ...``. Which levels print follows the server's
log settings, as Triton's do: verbose lines only at a verbose level of 1 or more
(``--log-verbose``), and info, warning and error lines unless the settings turn them
off. A worker reads them from its environment (``DLSERVE_LOG_VERBOSE``,
``DLSERVE_LOG_LEVELS``): set when it starts, and again when the settings change at run
time (the server sends them, ``ipc/log_environment.py``).
"""

from __future__ import annotations

import datetime
import enum
import os
import sys
import threading
from typing import ClassVar, Final

from dlserve.ipc.log_environment import FORMAT_ENV, LEVELS_ENV, VERBOSE_ENV
from dlserve.pb_utils import arguments
from dlserve.pb_utils.runtime import current as _runtime

_HERE: Final = os.path.dirname(os.path.abspath(__file__))
_write_lock: Final = threading.Lock()


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_Level = LogLevel  # for annotations inside Logger, whose LogLevel attribute shadows it

_LETTERS: Final = {LogLevel.INFO: "I", LogLevel.WARNING: "W", LogLevel.ERROR: "E",
                   LogLevel.VERBOSE: "I"}  # fmt: skip


_NAMES: Final = {LogLevel.INFO: "info", LogLevel.WARNING: "warning", LogLevel.ERROR: "error"}


def verbose_enabled() -> bool:
    try:
        return int(os.environ.get(VERBOSE_ENV, "0")) >= 1
    except ValueError:
        return False


def enabled(level: LogLevel) -> bool:
    if level == LogLevel.VERBOSE:
        return verbose_enabled()
    return _NAMES[level] in os.environ.get(LEVELS_ENV, "info,warning,error").split(",")


def _caller() -> tuple[str, int]:
    """File name and line of the first frame outside this package (the model's code)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _HERE:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>", 0
    return os.path.basename(frame.f_code.co_filename), frame.f_lineno


def format_line(message: str, level: LogLevel, filename: str, lineno: int, model: str) -> str:
    now = datetime.datetime.now(datetime.UTC)
    where = f" [model '{model}']" if model else ""
    place = f"{os.getpid()} {filename}:{lineno}]{where} {message}\n"
    if os.environ.get(FORMAT_ENV) == "ISO8601":  # 2026-12-01T10:00:00Z I 4242 model.py:31]
        return f"{now.strftime('%Y-%m-%dT%H:%M:%SZ')} {_LETTERS[level]} {place}"
    return f"{_LETTERS[level]}{now.strftime('%m%d %H:%M:%S.%f')} {place}"


class Logger:
    """Triton's static logger: ``pb_utils.Logger.log_info("...")``."""

    LogLevel: ClassVar[type[_Level]] = _Level
    INFO: ClassVar[_Level] = _Level.INFO
    WARNING: ClassVar[_Level] = _Level.WARNING
    ERROR: ClassVar[_Level] = _Level.ERROR
    VERBOSE: ClassVar[_Level] = _Level.VERBOSE

    @staticmethod
    def log(message: str | bytes, level: _Level = _Level.INFO) -> None:
        """One line at ``level`` (a LogLevel: a plain number is refused, as in Triton)."""
        try:
            if not isinstance(level, _Level):
                raise arguments.NotText
            message = arguments.text(message, "the log message", message=True)
        except arguments.NotText:
            raise arguments.incompatible("log", _LOG_SIGNATURE, (message, level)) from None
        _write(message, level)

    @staticmethod
    def log_info(message: str | bytes) -> None:
        _log_one("log_info", message, _Level.INFO)

    @staticmethod
    def log_warn(message: str | bytes) -> None:
        _log_one("log_warn", message, _Level.WARNING)

    @staticmethod
    def log_error(message: str | bytes) -> None:
        _log_one("log_error", message, _Level.ERROR)

    @staticmethod
    def log_verbose(message: str | bytes) -> None:
        _log_one("log_verbose", message, _Level.VERBOSE)


_LOG_SIGNATURE: Final = (
    f"(message: str, level: {arguments.MODULE}.Logger.LogLevel = <LogLevel.INFO: 0>) -> None"
)


def _log_one(function: str, message: object, level: LogLevel) -> None:
    """``Logger.log_info`` and its siblings: one argument, the message."""
    try:
        text = arguments.text(message, "the log message", message=True)
    except arguments.NotText:
        raise arguments.incompatible(function, "(message: str) -> None", (message,)) from None
    _write(text, level)


def _write(message: str, level: LogLevel) -> None:
    if not enabled(level):
        return
    filename, lineno = _caller()
    line = format_line(message, level, filename, lineno, _runtime().model_name())
    with _write_lock:
        sys.stderr.write(line)
        sys.stderr.flush()
