"""The BLS router, driven through the service in one process: a model's call runs through
its callee's scheduler like a client's request, and a call that no instance of its callee
could serve (every one waits on the call chain) is refused at once.
"""

from __future__ import annotations

import numpy as np
import pytest

from dlserve import errors
from dlserve.types import InferRequest, ParamValue

from .harness import Core, in_flight, output, pending, request, scalars, tensor, until


def serial(value: float, **parameters: ParamValue) -> InferRequest:
    return request("serial", tensor("INPUT0", [value], "FP32"), **parameters)


async def test_a_bls_call_waits_its_turn_in_the_callee_s_scheduler(core: Core) -> None:
    """bls_by_name calls serial while a client's request holds serial's only instance: the
    call waits (pending) like a client's, runs in its turn between the client's requests,
    and counts in serial's statistics. Calls go through the server (no direct calls)."""
    async with core.serving("serial", "bls_by_name", bls_direct=False) as service:
        gate = core.gate()
        first = in_flight(service.infer(serial(0.5, **gate.parameters)))
        await gate.started()
        call = request(
            "bls_by_name", tensor("MODEL_NAME", np.array([b"serial"], np.object_), "BYTES"),
            tensor("INPUT0", [3.0], "FP32"), mode="sync",
        )  # fmt: skip
        caller = in_flight(service.infer(call))
        await until(lambda: pending(service, "serial") == 1, "the call waits for serial")
        last = in_flight(service.infer(serial(4.0)))
        await until(lambda: pending(service, "serial") == 2, "the client's request waits too")
        await gate.open()
        assert scalars(await first, ["EXECUTION"]) == {"EXECUTION": 1}
        answer = await caller
        np.testing.assert_array_equal(output(answer, "OUTPUT0"), [6.0])
        np.testing.assert_array_equal(output(answer, "DIRECT"), [False])
        assert scalars(await last, ["EXECUTION"]) == {"EXECUTION": 3}  # the call was 2
        (stats,) = service.statistics("serial")
        assert (stats.inference_count, stats.execution_count) == (3, 3)


@pytest.mark.parametrize("bls_direct", [True, False], ids=["direct", "through-server"])
async def test_a_call_only_the_caller_s_own_instance_could_serve_is_refused(
    core: Core, bls_direct: bool
) -> None:
    """bls_pipeline has one instance, and it runs the caller: a call into bls_pipeline
    could only wait for itself. It is refused at once, and the instance serves on."""
    async with core.serving(
        "bls_pipeline", "double", "async_execute", bls_direct=bls_direct
    ) as service:
        itself = request("bls_pipeline", tensor("INPUT0", [1.0], "FP32"), mode="itself")
        with pytest.raises(errors.DlserveError) as refused:
            await service.infer(itself)
        message = refused.value.message
        assert "circular BLS call bls_pipeline -> bls_pipeline" in message
        assert "every instance of model 'bls_pipeline' (1) is already waiting" in message
        served = request("bls_pipeline", tensor("INPUT0", [1.0], "FP32"), mode="sync")
        np.testing.assert_array_equal(output(await service.infer(served), "OUTPUT0"), [3.0])
