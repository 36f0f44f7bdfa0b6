"""``pb_utils.Logger``: log lines from model code, in Triton's format, on the worker's stderr.

A line reads ``I0612 10:00:00.123456 4242 model.py:31] [model 'name'] message``: the
level letter, UTC time, the process id, the caller's file and line (as Triton
prints them) and the model the worker serves. Verbose lines appear only when
``DLSERVE_LOG_VERBOSE`` is set to a level of 1 or more in the server's environment
(Triton shows them only at ``--log-verbose`` >= 1).
"""

from __future__ import annotations

import datetime
import enum
import os
import sys
import threading
from typing import ClassVar, Final

from dlserve.backend import link

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


def verbose_enabled() -> bool:
    try:
        return int(os.environ.get("DLSERVE_LOG_VERBOSE", "0")) >= 1
    except ValueError:
        return False


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
    stamp = now.strftime("%m%d %H:%M:%S.%f")
    where = f" [model '{model}']" if model else ""
    return f"{_LETTERS[level]}{stamp} {os.getpid()} {filename}:{lineno}]{where} {message}\n"


class Logger:
    """Triton's static logger: ``pb_utils.Logger.log_info("...")``."""

    LogLevel: ClassVar[type[_Level]] = _Level
    INFO: ClassVar[_Level] = _Level.INFO
    WARNING: ClassVar[_Level] = _Level.WARNING
    ERROR: ClassVar[_Level] = _Level.ERROR
    VERBOSE: ClassVar[_Level] = _Level.VERBOSE

    @staticmethod
    def log(message: str, level: _Level = _Level.INFO) -> None:
        level = _Level(level)
        if level == _Level.VERBOSE and not verbose_enabled():
            return
        filename, lineno = _caller()
        worker = link.current()
        model = worker.model_name if worker is not None else ""
        line = format_line(str(message), level, filename, lineno, model)
        with _write_lock:
            sys.stderr.write(line)
            sys.stderr.flush()

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, _Level.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, _Level.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, _Level.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, _Level.VERBOSE)
