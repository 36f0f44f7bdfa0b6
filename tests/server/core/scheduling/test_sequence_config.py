"""sequence_batching checked at load (what dlserve refuses, with the reason) and a
request's sequence parameters read as the core consumes them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dlserve import errors
from dlserve.server.core.models.config import ConfigError, normalize
from dlserve.server.core.scheduling.sequence_config import SequenceSettings, pop_sequence

INPUTS = 'input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'


def config(sequence: str, max_batch_size: int = 0) -> Any:
    text = f"max_batch_size: {max_batch_size}\n{INPUTS}sequence_batching {{ {sequence} }}"
    parsed = text_format.Parse(text, mc.ModelConfig())
    normalize(parsed, "seq", 0)
    return parsed


def refused(sequence: str) -> str:
    with pytest.raises(ConfigError) as caught:
        config(sequence)
    print(caught.value)
    return str(caught.value)


def control(name: str, body: str) -> str:
    return f'control_input [ {{ name: "{name}" control [ {{ {body} }} ] }} ]'


@pytest.mark.parametrize(
    ("sequence", "what"),
    [
        ("oldest { }", "'oldest'"),
        ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [1] } ]',
         "'state' (implicit state)"),
        ("iterative_sequence: true "
         'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START '
         "int32_false_true: [0, 1] } ] } ]",
         "'iterative_sequence' with control inputs"),
        ("direct { max_queue_delay_microseconds: 100 }", "'direct' with max_queue_delay"),
        ("direct { minimum_slot_utilization: 0.5 }", "'direct' with max_queue_delay"),
    ],
)  # fmt: skip
def test_what_dlserve_does_not_do_is_refused_with_the_reason(sequence: str, what: str) -> None:
    message = refused(sequence)
    assert message.startswith(f"model 'seq': sequence_batching {what}")
    assert "is not supported by dlserve" in message


def test_controls_are_checked_as_triton_checks_them() -> None:
    start = "kind: CONTROL_SEQUENCE_START"
    assert refused(control("S", start)) == (
        "sequence batching must specify exactly one of 'int32_false_true', 'fp32_false_true' "
        "or 'bool_false_true' for CONTROL_SEQUENCE_START for seq"
    )
    assert "'int32_false_true' must have exactly 2 entries" in refused(
        control("S", f"{start} int32_false_true: [ 1 ]")
    )
    assert "exactly one of" in refused(
        control("S", f"{start} int32_false_true: [0, 1] fp32_false_true: [0, 1]")
    )
    twice = ('control_input [ { name: "A" control [ { kind: CONTROL_SEQUENCE_END '
             'int32_false_true: [0, 1] } ] }, { name: "B" control [ { kind: '
             "CONTROL_SEQUENCE_END int32_false_true: [0, 1] } ] } ]")  # fmt: skip
    assert (
        refused(twice)
        == "sequence batching specifies multiple CONTROL_SEQUENCE_END tensors for seq"
    )
    assert "unexpected control data type" in refused(
        control("C", "kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32")
    )
    assert "is also declared as an input" in refused(
        control("INPUT", f"{start} int32_false_true: [0, 1]")
    )


def test_settings_hold_the_control_values_and_triton_defaults() -> None:
    parsed = config(
        'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START '
        'fp32_false_true: [ 0.5, 2 ] } ] }, { name: "R" control [ { kind: '
        "CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] }, "
        '{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]',
        max_batch_size=4,
    )
    settings = SequenceSettings.from_config(parsed)
    assert parsed.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    assert (settings.idle_ns, settings.slots, settings.batched) == (10**9, 4, True)
    start, ready = settings.controls
    assert (start.name, start.datatype) == ("S", "FP32")
    assert np.frombuffer(start.false + start.true, np.float32).tolist() == [0.5, 2.0]
    assert (ready.datatype, ready.false, ready.true) == ("BOOL", b"\x00", b"\x01")
    assert settings.corrid is not None and settings.corrid.datatype == "BYTES"


def test_sequence_parameters_are_taken_out_of_the_request() -> None:
    params: dict[str, Any] = {"sequence_id": 7, "sequence_start": True, "sequence_end": False,
                              "mine": 1}  # fmt: skip
    assert pop_sequence(params) == (7, 1)
    assert params == {"mine": 1}
    assert pop_sequence({"sequence_id": "abc", "sequence_end": True}) == ("abc", 2)
    assert pop_sequence({"sequence_id": 2**64 - 1}) == (2**64 - 1, 0)
    assert pop_sequence({}) == (0, 0)
    for bad in ({"sequence_id": -1}, {"sequence_id": 1.5}, {"sequence_id": True},
                {"sequence_start": 1}, {"sequence_end": "yes"}):  # fmt: skip
        with pytest.raises(errors.InvalidArgumentError):
            pop_sequence(dict(bad))
