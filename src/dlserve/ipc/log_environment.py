"""The log settings of model code, as a worker reads them: environment variables, set
when the worker starts and again when the server's settings change at run time (the
server sends them in a ``LogSettings`` frame; ``pb_utils.Logger`` reads them)."""

from __future__ import annotations

from typing import Final

VERBOSE_ENV: Final = "DLSERVE_LOG_VERBOSE"
LEVELS_ENV: Final = "DLSERVE_LOG_LEVELS"  # the levels that print: "info,warning,error"
FORMAT_ENV: Final = "DLSERVE_LOG_FORMAT"  # "default" or "ISO8601"


def log_settings_env(
    verbose: int, info: bool, warning: bool, error: bool, iso8601: bool = False
) -> dict[str, str]:
    """The environment that says which levels print, and in which format."""
    levels = [name for name, on in (("info", info), ("warning", warning), ("error", error)) if on]
    return {VERBOSE_ENV: str(verbose), LEVELS_ENV: ",".join(levels),
            FORMAT_ENV: "ISO8601" if iso8601 else "default"}  # fmt: skip
