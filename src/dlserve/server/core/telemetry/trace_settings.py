"""Trace settings, global and per model, shared by both protocols, as Triton keeps them
(its server's ``src/tracer.cc``).

Values are lists of strings, as Triton's gRPC TraceSetting carries them; the HTTP
frontend shows every setting but ``trace_level`` as a single string. Behind the values
the API shows, each model with settings of its own, and the global setting, has a
:class:`Setting`: the values in effect and the sampling state (how many requests it has
seen, how many traces it may still take, the traces not written yet). An update never
changes a Setting: it replaces it (and the models' ones that mirror the global values),
so counting starts again, and the replaced one is *retired*: written out once its last
trace is done (``Tracer``). The count the API shows is the remaining one, going down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from dlserve.errors import InvalidArgumentError, UnsupportedError

log = logging.getLogger("dlserve")

DEFAULTS: Final[Mapping[str, Sequence[str]]] = {
    "trace_level": ("OFF",), "trace_rate": ("1000",), "trace_count": ("-1",),
    "log_frequency": ("0",), "trace_file": ("",), "trace_mode": ("triton",),
}  # fmt: skip
LEVELS: Final = ("OFF", "TIMESTAMPS", "TENSORS")
NUMBERS: Final = ("trace_rate", "trace_count", "log_frequency")
_NO_FILE: Final = (
    "trace_level %s traces nothing: no trace file was given at start "
    "(--trace-config triton,file=PATH)"
)


class Setting:
    """The settings in effect for a model (or globally) and their sampling state, as
    Triton's ``TraceSetting``: every ``rate``-th request it is asked about is traced,
    ``count`` more at most (-1: no limit)."""

    __slots__ = ("collected", "count", "file", "in_stream", "level", "log_frequency",
                 "open", "pending", "rate", "retired", "sample", "tensors", "timestamps",
                 "valid")  # fmt: skip

    def __init__(self, values: Mapping[str, Sequence[str]]) -> None:
        self.level = tuple(values["trace_level"]) or ("OFF",)
        self.timestamps = "TIMESTAMPS" in self.level
        self.tensors = "TENSORS" in self.level
        self.rate = int(values["trace_rate"][0])
        self.count = int(values["trace_count"][0])
        self.log_frequency = int(values["log_frequency"][0])
        self.file = values["trace_file"][0] if values["trace_file"] else ""
        self.sample = 0  # requests seen while valid (Triton's sample_)
        self.collected = 0  # traces done (written to ``pending``)
        self.in_stream = 0  # traces in ``pending``
        self.pending: list[str] = []  # done traces' JSON, not written to the file yet
        self.open = 0  # traces taken and not done yet
        self.retired = False  # replaced by an update (or the server stops)
        self.valid = False
        self.check()

    def check(self) -> None:
        """Whether requests are sampled: a level, a rate, a file and traces left."""
        on = self.timestamps or self.tensors
        self.valid = on and self.rate > 0 and bool(self.file) and self.count != 0

    def values(self) -> dict[str, list[str]]:
        return {
            "trace_level": list(self.level), "trace_rate": [str(self.rate)],
            "trace_count": [str(self.count)], "log_frequency": [str(self.log_frequency)],
            "trace_file": [self.file], "trace_mode": ["triton"],
        }  # fmt: skip


def _noop(setting: Setting) -> None:
    """No tracer: a retired setting needs nothing done."""


class TraceSettings:
    """The global setting (the startup values where the API has not set them) and the
    models' own, with Triton's fallbacks: a model's unset values are the global ones."""

    def __init__(
        self,
        startup: Mapping[str, Sequence[str]] | None = None,
        on_retire: Callable[[Setting], None] = _noop,
    ) -> None:
        self._defaults: dict[str, Sequence[str]] = {**DEFAULTS, **(startup or {})}
        self._global: dict[str, list[str]] = {}  # set through the API
        self._models: dict[str, dict[str, list[str]]] = {}
        self._on_retire = on_retire
        self.global_setting = Setting(self._defaults)
        self.model_settings: dict[str, Setting] = {}
        self.active = self.global_setting.valid  # some setting samples requests

    def effective(self, model: str) -> Setting:
        return self.model_settings.get(model, self.global_setting)

    def get(self, model: str = "") -> dict[str, list[str]]:
        return self.effective(model).values()

    def update(self, model: str, updates: Mapping[str, list[str]]) -> None:
        """Apply every update or none; an empty value list clears the setting
        (a model's goes back to the global one, a global one to its startup value)."""
        checked = {k: _check(k, v) for k, v in updates.items() if k in DEFAULTS}
        fresh = {k for k, v in checked.items() if v}
        if model:
            self._update_model(model, _apply(self._models.get(model, {}), checked), fresh)
        else:
            self._update_global(_apply(self._global, checked), fresh)
        self.refresh()

    def _update_model(self, model: str, own: dict[str, list[str]], fresh: set[str]) -> None:
        old = self.model_settings.get(model)
        if not own:  # nothing of its own left: the model follows the global setting
            self._models.pop(model, None)
            self.model_settings.pop(model, None)
        else:
            new = _build(self.global_setting.values(), own, old, fresh)
            _validate(new)
            self._models[model] = own
            self.model_settings[model] = new
        if old is not None:
            self._retire(old)

    def _update_global(self, own: dict[str, list[str]], fresh: set[str]) -> None:
        new = _build(self._defaults, own, self.global_setting, fresh)
        models = {
            name: _build(new.values(), over, self.model_settings.get(name), set())
            for name, over in self._models.items()
        }
        _validate(new)
        for setting in models.values():
            _validate(setting)
        old = [self.global_setting, *self.model_settings.values()]
        self._global, self.global_setting, self.model_settings = own, new, models
        for setting in old:
            self._retire(setting)

    def _retire(self, setting: Setting) -> None:
        setting.retired = True
        self._on_retire(setting)

    def refresh(self) -> None:
        """Recompute ``active`` (a setting was replaced, or one ran out of traces)."""
        settings = [self.global_setting, *self.model_settings.values()]
        self.active = any(s.valid for s in settings)

    def retire_all(self) -> None:
        """The server stops: every setting in use is retired."""
        for setting in [self.global_setting, *self.model_settings.values()]:
            setting.retired = True
            self._on_retire(setting)
        self.active = False


def _apply(
    current: Mapping[str, list[str]], checked: Mapping[str, list[str]]
) -> dict[str, list[str]]:
    result = dict(current)
    for key, values in checked.items():
        if values:
            result[key] = values
        else:
            result.pop(key, None)
    return result


def _build(
    base: Mapping[str, Sequence[str]], own: Mapping[str, list[str]], old: Setting | None,
    fresh: set[str],
) -> Setting:  # fmt: skip
    """A setting from its fallback values and its own; a count of its own that this update
    does not set goes on from what the replaced setting had left."""
    values: dict[str, Sequence[str]] = {**base, **own}
    if old is not None and "trace_count" in own and "trace_count" not in fresh:
        values["trace_count"] = [str(old.count)]
    setting = Setting(values)
    if (setting.timestamps or setting.tensors) and not setting.file:
        log.warning(_NO_FILE, ",".join(setting.level))
    return setting


def _validate(setting: Setting) -> None:
    if (setting.timestamps or setting.tensors) and setting.rate == 0:
        raise InvalidArgumentError(
            "Attempting to set invalid trace setting :sample rate must be non-zero"
        )


def _check(key: str, values: list[str]) -> list[str]:
    if key == "trace_file":
        raise UnsupportedError("trace file location can not be updated through network protocol")
    if key == "trace_mode":
        if values and values != ["triton"]:
            raise InvalidArgumentError("trace mode can not be updated through network protocol")
    elif key == "trace_level":
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
