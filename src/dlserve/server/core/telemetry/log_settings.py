"""The server's log settings (Triton's logging extension): read and changed at run time;
a change reaches the server's own log level and every worker (``pb_utils.Logger``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core.instances import handle as worker_client


class LogSettings:
    def __init__(self, verbose: int, log_file: str = "") -> None:
        self.values: dict[str, Any] = {
            "log_file": log_file, "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": verbose, "log_format": "default",
        }  # fmt: skip

    def update(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Apply ``settings`` (checked by the frontend as Triton checks them); all of them now."""
        for key, value in settings.items():
            if key not in self.values:
                raise errors.InvalidArgumentError(f"Logging setting '{key}' is unknown")
            self.values[key] = value
        self._apply_log_level()
        values = self.values
        worker_client.apply_log_settings(m.LogSettings(
            int(values["log_verbose_level"]), bool(values["log_info"]),
            bool(values["log_warning"]), bool(values["log_error"]),
            values["log_format"] == "ISO8601",
        ))  # fmt: skip
        return dict(values)

    def _apply_log_level(self) -> None:
        level = logging.INFO if self.values["log_info"] else logging.WARNING
        if not self.values["log_warning"]:
            level = logging.ERROR
        if self.values["log_verbose_level"]:
            level = logging.DEBUG
        logging.getLogger("dlserve").setLevel(level)
        iso = self.values["log_format"] == "ISO8601"
        for handler in logging.getLogger().handlers:  # the server's own lines
            if handler.formatter is not None:
                handler.formatter.datefmt = "%Y-%m-%dT%H:%M:%SZ" if iso else None
                handler.formatter.converter = time.gmtime if iso else time.localtime
