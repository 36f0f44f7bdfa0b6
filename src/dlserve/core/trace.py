"""Trace settings, global and per model, shared by both protocols.

Kept and checked as Triton checks them; nothing is traced yet. Values are lists
of strings, as Triton's gRPC TraceSetting carries them; the HTTP frontend shows
every setting but ``trace_level`` as a single string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from dlserve.errors import InvalidArgumentError, UnsupportedError

DEFAULTS: Final[Mapping[str, Sequence[str]]] = {
    "trace_level": ("OFF",), "trace_rate": ("1000",), "trace_count": ("-1",),
    "log_frequency": ("0",), "trace_file": ("",), "trace_mode": ("triton",),
}  # fmt: skip
LEVELS: Final = ("OFF", "TIMESTAMPS", "TENSORS")
NUMBERS: Final = ("trace_rate", "trace_count", "log_frequency")


class TraceSettings:
    def __init__(self) -> None:
        self._global: dict[str, list[str]] = {k: list(v) for k, v in DEFAULTS.items()}
        self._models: dict[str, dict[str, list[str]]] = {}

    def get(self, model: str = "") -> dict[str, list[str]]:
        return {**self._global, **self._models.get(model, {})}

    def update(self, model: str, updates: Mapping[str, list[str]]) -> None:
        """Apply every update or none; an empty value list clears the setting
        (a model's goes back to the global one, a global one to its default)."""
        checked = {k: _check(k, v) for k, v in updates.items() if k in DEFAULTS}
        target = self._models.setdefault(model, {}) if model else self._global
        for key, values in checked.items():
            if values:
                target[key] = values
            elif model:
                target.pop(key, None)
            else:
                target[key] = list(DEFAULTS[key])


def _check(key: str, values: list[str]) -> list[str]:
    if key == "trace_file":
        raise UnsupportedError("trace file location can not be updated through network protocol")
    if key == "trace_level":
        if "OFF" in values and len(values) > 1:
            raise InvalidArgumentError("Expect only one trace level 'OFF' is specified")
        for level in values:
            if level not in LEVELS:
                raise InvalidArgumentError(f"unknown trace level '{level}'")
    elif key in NUMBERS:
        if len(values) > 1:
            raise InvalidArgumentError(f"expect only 1 value for '{key}'")
        if values and not _is_int(values[0], -1 if key == "trace_count" else 0):
            raise InvalidArgumentError(f"Unable to parse '{key}', got: {values[0]}")
    return values


def _is_int(text: str, minimum: int) -> bool:
    try:
        return int(text) >= minimum
    except ValueError:
        return False
