"""``--trace-config``, read as Triton's server reads it (``src/command_line_parser.cc``):
``<setting>=<value>`` for the global settings (``level``, repeatable; ``rate``; ``count``;
``mode``) and ``triton,<setting>=<value>`` for the trace file (``file``,
``log-frequency``). The result is the startup trace settings, in the form the trace
settings API shows them. Errors are ``ValueError`` with Triton's messages.

Where Triton is lenient dlserve refuses, so that nothing is silently not traced: an
unknown setting, ``mode=opentelemetry`` (dlserve has Triton's mode only), a level with no
file to write to, negative numbers (docs/differences.md)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Final

_FORMAT: Final = "--trace-config option format is '<trace mode>,<setting>=<value>'. Got {}"
_OTEL: Final = (
    "--trace-config {}: the OpenTelemetry trace mode is not supported by dlserve "
    '(its trace mode is "triton": Triton\'s JSON trace file)'
)
_LEVELS: Final = {
    "false": "OFF", "off": "OFF", "true": "TIMESTAMPS", "on": "TIMESTAMPS",
    "min": "TIMESTAMPS", "max": "TIMESTAMPS", "timestamps": "TIMESTAMPS",
    "tensors": "TENSORS",
}  # fmt: skip


def parse_trace_config(args: Sequence[str], cwd: str = "") -> dict[str, list[str]]:
    """The startup trace settings that the ``--trace-config`` values ``args`` give."""
    levels: list[str] = []
    result: dict[str, list[str]] = {}
    for arg in args:
        mode, setting, value = _split(arg)
        if mode == "opentelemetry":
            raise ValueError(_OTEL.format(arg))
        if mode:
            _triton_setting(setting, value, result, cwd)
        elif setting == "level":
            levels.append(_level(setting, value))
        else:
            _global_setting(setting, value, result, arg)
    if levels:
        on: list[str] = [lv for lv in ("TIMESTAMPS", "TENSORS") if lv in levels]
        # an explicit OFF disables tracing whatever else is given (Triton's rule)
        result["trace_level"] = ["OFF"] if "OFF" in levels or not on else on
    if result.get("trace_level", ["OFF"]) != ["OFF"] and not result.get("trace_file", [""])[0]:
        raise ValueError(
            "--trace-config level=" + ",".join(result["trace_level"]) + " needs a trace file "
            "to write to: --trace-config triton,file=<path>"
        )
    if "trace_file" in result:
        _check_folder(result["trace_file"][0])
    return result


def _check_folder(path: str) -> None:
    """The trace file's folder must exist and be writable: found out now, not when the
    first traces are written (and lost)."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(
            f"--trace-config triton,file={path}: the folder {folder} does not exist or is "
            "not writable"
        )


def _split(arg: str) -> tuple[str, str, str]:
    comma = arg.find(",")
    mode = ""
    if comma == 0:
        raise ValueError(
            "No trace mode specified. --trace-config option format is "
            f"<trace mode>,<setting>=<value> or <setting>=<value>. Got {arg}"
        )
    if comma > 0 and "=" in arg[comma:]:
        mode = _mode(arg[:comma])
        rest = arg[comma + 1 :]
    else:
        rest = arg
    setting, equals, value = rest.partition("=")
    if not equals or not setting or not value:
        raise ValueError(_FORMAT.format(arg))
    return mode, setting, value


def _mode(text: str) -> str:
    mode = text.lower()
    if mode not in ("triton", "opentelemetry"):
        raise ValueError(
            f"invalid value for trace mode option: {text}. "
            'Available options are "triton" and "opentelemetry"'
        )
    return mode


def _bad(setting: str, reason: str) -> ValueError:
    return ValueError(f'Bad option: "--trace-config {setting}".\n{reason}')


def _level(setting: str, value: str) -> str:
    level = _LEVELS.get(value.lower())
    if level is None:
        raise _bad(setting, f"invalid value for trace level option: {value}")
    return level


def _number(setting: str, value: str, minimum: int) -> str:
    try:
        number = int(value)
    except ValueError:
        raise _bad(setting, f"Invalid option value. Got {value}") from None
    if number < minimum:
        raise _bad(setting, f"The value must be at least {minimum}. Got {value}")
    return str(number)


def _global_setting(setting: str, value: str, result: dict[str, list[str]], arg: str) -> None:
    if setting == "rate":
        result["trace_rate"] = [_number(setting, value, 1)]
    elif setting == "count":
        result["trace_count"] = [_number(setting, value, -1)]
    elif setting == "mode":
        if _mode(value) == "opentelemetry":
            raise ValueError(_OTEL.format(arg))
    else:
        raise _bad(setting, "Unknown setting: the global ones are level, rate, count and mode")


def _triton_setting(setting: str, value: str, result: dict[str, list[str]], cwd: str) -> None:
    if setting == "file":
        result["trace_file"] = [value if not cwd or value.startswith("/") else f"{cwd}/{value}"]
    elif setting == "log-frequency":
        result["log_frequency"] = [_number(f"triton,{setting}", value, 0)]
    else:
        raise _bad(
            f"triton,{setting}", "Unknown setting: the triton ones are file and log-frequency"
        )
