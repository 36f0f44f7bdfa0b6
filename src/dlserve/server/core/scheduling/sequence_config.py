"""``sequence_batching`` in config.pbtxt: checked at load, read once into settings.

What dlserve supports is Triton's direct strategy: a sequence is bound to one instance
from its START to its END (or its idle timeout), with the control inputs START, END,
READY and CORRID; and iterative sequences (``server/core/scheduling/iterative.py``), without control
inputs. A config that asks for more (the oldest strategy, implicit state, a direct queue
delay) is refused with the reason, so the model is UNAVAILABLE rather than served with a
behaviour it did not ask for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from dlserve.errors import InvalidArgumentError
from dlserve.server.core.models.config import ConfigError

Control = mc.ModelSequenceBatching.Control
START = Control.CONTROL_SEQUENCE_START
END = Control.CONTROL_SEQUENCE_END
READY = Control.CONTROL_SEQUENCE_READY
CORRID = Control.CONTROL_SEQUENCE_CORRID

# Triton's default when max_sequence_idle_microseconds is 0 (or absent): one second
DEFAULT_IDLE_US = 1_000_000

_BOOL_TYPES = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}
_CORRID_TYPES = {
    mc.TYPE_UINT64: "UINT64", mc.TYPE_INT64: "INT64", mc.TYPE_UINT32: "UINT32",
    mc.TYPE_INT32: "INT32", mc.TYPE_STRING: "BYTES",
}  # fmt: skip
_NUMPY = {"INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64,
          "INT64": np.int64, "UINT32": np.uint32}  # fmt: skip


@dataclass(frozen=True, slots=True)
class BoolControl:
    """A START, END or READY input: its name, wire data type and (false, true) values as
    little-endian bytes of one element."""

    name: str
    kind: int
    datatype: str
    false: bytes
    true: bytes


@dataclass(frozen=True, slots=True)
class CorridControl:
    name: str
    datatype: str  # UINT64, INT64, UINT32, INT32 or BYTES


@dataclass(frozen=True, slots=True)
class SequenceSettings:
    idle_ns: int
    slots: int  # sequences bound to one instance at once: max(1, max_batch_size), Triton's
    batched: bool  # max_batch_size > 0: control inputs have a batch dimension
    controls: tuple[BoolControl, ...]
    corrid: CorridControl | None

    @classmethod
    def from_config(cls, config: Any) -> SequenceSettings:
        """The settings of a config that :func:`check` accepted."""
        batching = config.sequence_batching
        controls: list[BoolControl] = []
        corrid = None
        for entry in batching.control_input:
            for control in entry.control:
                if control.kind == CORRID:
                    corrid = CorridControl(entry.name, _CORRID_TYPES[control.data_type])
                else:
                    controls.append(_bool_control(entry.name, control))
        return cls(
            batching.max_sequence_idle_microseconds * 1000,
            max(1, config.max_batch_size),
            config.max_batch_size > 0,
            tuple(controls),
            corrid,
        )


def _bool_control(name: str, control: Any) -> BoolControl:
    for field, datatype in _BOOL_TYPES.items():
        values = list(getattr(control, field))
        if values:
            false, true = (np.array([v], _NUMPY[datatype]).tobytes() for v in values)
            return BoolControl(name, control.kind, datatype, false, true)
    raise AssertionError("checked at load")


def check(config: Any, name: str) -> None:
    """Refuse what dlserve's sequence batcher does not do; fill Triton's defaults."""
    batching = config.sequence_batching
    unsupported = _unsupported(batching)
    if unsupported:
        raise ConfigError(
            f"model '{name}': sequence_batching {unsupported} is not supported by dlserve "
            "(supported: the direct strategy with control inputs START, END, READY and "
            "CORRID, and max_sequence_idle_microseconds; iterative_sequence without control "
            "inputs)"
        )
    if batching.max_sequence_idle_microseconds == 0:
        batching.max_sequence_idle_microseconds = DEFAULT_IDLE_US
    inputs = {entry.name for entry in config.input}
    seen_tensors: set[str] = set()
    seen_kinds: set[int] = set()
    for entry in batching.control_input:
        if not entry.name:
            raise ConfigError(f"sequence batching control tensor must have a name for {name}")
        if entry.name in seen_tensors or len(entry.control) > 1:
            raise ConfigError(
                f"sequence batching control tensor '{entry.name}' is specified for "
                f"multiple control kinds for {name}"
            )
        if entry.name in inputs:
            raise ConfigError(
                f"model '{name}': sequence batching control tensor '{entry.name}' is also "
                "declared as an input; the server supplies it"
            )
        seen_tensors.add(entry.name)
        for control in entry.control:
            kind = Control.Kind.Name(control.kind)
            if control.kind in seen_kinds:
                raise ConfigError(f"sequence batching specifies multiple {kind} tensors for {name}")
            seen_kinds.add(control.kind)
            if control.kind == CORRID:
                _check_corrid(control, kind, name)
            else:
                _check_bool(control, kind, name)


def _unsupported(batching: Any) -> str:
    if batching.HasField("oldest"):
        return "'oldest' (several sequences batched into one execute)"
    if batching.state:
        return "'state' (implicit state)"
    if batching.iterative_sequence and len(batching.control_input):
        return "'iterative_sequence' with control inputs (the scheduler would fill them)"
    direct = batching.direct
    if direct.max_queue_delay_microseconds or direct.minimum_slot_utilization:
        return "'direct' with max_queue_delay_microseconds or minimum_slot_utilization"
    return ""


def _check_bool(control: Any, kind: str, name: str) -> None:
    given = [f for f in _BOOL_TYPES if len(getattr(control, f))]
    if len(given) != 1:
        raise ConfigError(
            "sequence batching must specify exactly one of 'int32_false_true', "
            f"'fp32_false_true' or 'bool_false_true' for {kind} for {name}"
        )
    if len(getattr(control, given[0])) != 2:
        raise ConfigError(
            f"sequence batching control '{given[0]}' must have exactly 2 entries for "
            f"{kind} for {name}"
        )
    if control.data_type != mc.TYPE_INVALID:
        raise ConfigError(
            f"sequence batching control for {kind} must not specify 'data_type' for {name}"
        )


def _check_corrid(control: Any, kind: str, name: str) -> None:
    if any(len(getattr(control, f)) for f in _BOOL_TYPES):
        raise ConfigError(
            f"sequence batching control for {kind} must not specify '*_false_true' values "
            f"for {name}"
        )
    if control.data_type not in _CORRID_TYPES:
        raise ConfigError(
            "unexpected control data type, expected TYPE_UINT64, TYPE_INT64, TYPE_UINT32, "
            f"TYPE_INT32, or TYPE_STRING for {kind} for {name}"
        )


# -- a request's sequence parameters (Triton's; the core consumes them, for every model) --
SEQUENCE_ID = "sequence_id"
SEQUENCE_START = "sequence_start"
SEQUENCE_END = "sequence_end"
FLAG_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
FLAG_END = 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
_UINT64_MAX = 2**64 - 1


def pop_sequence(params: dict[str, Any]) -> tuple[int | str, int]:
    """Take the sequence parameters out of ``params``: the correlation id (0: none) and
    the flags; raises InvalidArgumentError for values of the wrong type."""
    corrid = params.pop(SEQUENCE_ID, 0)
    if (
        isinstance(corrid, bool)
        or not isinstance(corrid, int | str)
        or (isinstance(corrid, int) and not 0 <= corrid <= _UINT64_MAX)
    ):
        raise InvalidArgumentError(
            f"parameter '{SEQUENCE_ID}' must be an unsigned 64-bit integer or a string"
        )
    flags = 0
    for key, flag in ((SEQUENCE_START, FLAG_START), (SEQUENCE_END, FLAG_END)):
        value = params.pop(key, False)
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"parameter '{key}' must be a boolean")
        flags |= flag if value else 0
    return corrid, flags
