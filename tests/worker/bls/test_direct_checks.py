"""worker/bls/direct_caller.py: a direct BLS call is checked as the server checks it; a call of the
same form as one that passed is not checked again, any other is, and BYTES always are."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.tensors.validation import SpecValidator
from dlserve.worker.bls.direct_caller import CallSpec, Target


class CountingValidator(SpecValidator):
    """The real checks, counted."""

    def __init__(self, real: SpecValidator) -> None:
        super().__init__(real.model, real.max_batch_size, list(real.inputs.values()),
                         list(real.outputs.values()))  # fmt: skip
        self.checks = 0

    def check(self, request):  # type: ignore[no-untyped-def]
        self.checks += 1
        return super().check(request)


def target(datatype: str) -> tuple[Target, CountingValidator]:
    spec = [m.DirectSpec("INPUT0", datatype, [-1])]
    msg = m.DirectTargets(1, target=7, max_batch_size=0, inputs=spec,
                          outputs=[m.DirectSpec("OUTPUT0", datatype, [-1])])  # fmt: skip
    found = Target("callee", msg, [])
    counting = found.validator = CountingValidator(found.validator)
    return found, counting


def inline(
    datatype: str, shape: list[int], data: bytes
) -> tuple[list[m.TensorRef], list[memoryview]]:
    ref = m.TensorRef("INPUT0", datatype, shape, m.Where.PAYLOAD, 0, len(data))
    return [ref], [memoryview(data)]


CALL = CallSpec("", ["OUTPUT0"], {}, ["caller"])


def test_a_call_of_a_form_that_passed_is_not_checked_again() -> None:
    callee, validator = target("FP32")
    four = np.arange(4, dtype=np.float32).tobytes()
    for _ in range(3):
        assert callee.check(CALL, *inline("FP32", [4], four)) == 1
    assert validator.checks == 1
    five = np.arange(5, dtype=np.float32).tobytes()
    assert callee.check(CALL, *inline("FP32", [5], five)) == 1  # another shape: checked
    assert validator.checks == 2


def test_a_call_of_another_form_still_fails_the_checks() -> None:
    callee, _ = target("FP32")
    four = np.arange(4, dtype=np.float32).tobytes()
    callee.check(CALL, *inline("FP32", [4], four))
    with pytest.raises(errors.InvalidArgumentError, match="data-type is 'INT32'"):
        callee.check(CALL, *inline("INT32", [4], four))
    with pytest.raises(errors.InvalidArgumentError, match="Expected 20, got 16"):
        callee.check(CALL, *inline("FP32", [5], four))
    other = CallSpec("", ["NOPE"], {}, ["caller"])
    with pytest.raises(errors.InvalidArgumentError, match="unexpected inference output 'NOPE'"):
        callee.check(other, *inline("FP32", [4], four))


def test_bytes_inputs_are_always_checked() -> None:
    callee, validator = target("BYTES")
    two = b"".join(struct.pack("<I", 3) + b"abc" for _ in range(2))  # two elements, 14 bytes
    assert callee.check(CALL, *inline("BYTES", [2], two)) == 1
    one = struct.pack("<I", 10) + b"abcdefghij"  # one element, also 14 bytes
    with pytest.raises(errors.InvalidArgumentError, match="unexpected number of string"):
        callee.check(CALL, *inline("BYTES", [2], one))
    assert validator.checks == 2
