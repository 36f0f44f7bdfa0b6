"""pb_utils.InferenceRequest / InferenceResponse / TritonError / TritonModelException."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from dlserve import pb_utils as pb_utils
from dlserve.errors import ErrorCode


def test_request_accessors() -> None:
    tensor = pb_utils.Tensor("INPUT0", np.zeros(2, np.float32))
    request = pb_utils.InferenceRequest(
        model_name="m",
        inputs=[tensor],
        requested_output_names=["OUTPUT0"],
        request_id="r1",
        correlation_id="c7",
        flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        model_version=3,
        timeout=5,
        parameters={"a": 1, "b": "x", "c": True, "d": 0.5},
    )
    assert request.inputs() == [tensor]
    assert request.requested_output_names() == ["OUTPUT0"]
    assert request.request_id() == "r1"
    assert request.correlation_id() == "c7"
    assert request.flags() == 1
    assert (request.model_name(), request.model_version(), request.timeout()) == ("m", 3, 5)
    assert json.loads(request.parameters()) == {"a": 1, "b": "x", "c": True, "d": 0.5}
    assert not request.is_cancelled()
    assert pb_utils.get_input_tensor_by_name(request, "INPUT0") is tensor
    assert pb_utils.get_input_tensor_by_name(request, "NOPE") is None
    request.set_flags(2)
    assert request.flags() == 2


def bls_request(**kwargs: Any) -> pb_utils.InferenceRequest:
    """A BLS request of model "m" with what Triton requires, and ``kwargs``."""
    return pb_utils.InferenceRequest(
        **{"model_name": "m", "inputs": [], "requested_output_names": [], **kwargs}
    )


def test_request_refusals() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="Correlation ID"):
        bls_request(correlation_id=1.5)
    with pytest.raises(pb_utils.TritonModelException, match="keys to have type str"):
        bls_request(parameters={1: "x"})
    with pytest.raises(pb_utils.TritonModelException, match="bool/int/float/str"):
        bls_request(parameters={"x": [1]})
    with pytest.raises(pb_utils.TritonModelException, match="only available inside"):
        bls_request().exec()
    sender = bls_request().get_response_sender()  # a BLS request's
    with pytest.raises(pb_utils.TritonModelException) as refused:
        sender.send(pb_utils.InferenceResponse())
    assert refused.value.message() == (
        "Unable to send response. Response sender has no reference to the decoupled state of "
        "the model."
    )


def test_response_sender_sends_until_the_final_flag() -> None:
    request = bls_request()
    sent: list[tuple[object, int]] = []
    sender = pb_utils.InferenceResponseSender(request, lambda r, f: sent.append((r, f)))
    request._sender = sender
    response = pb_utils.InferenceResponse()
    with pytest.raises(pb_utils.TritonModelException, match="must be provided"):
        sender.send()
    sender.send(response)
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sent == [(response, 0), (None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)]
    with pytest.raises(pb_utils.TritonModelException, match="Response sender has been closed"):
        sender.send(response)
    assert request.get_response_sender() is sender and not sender.is_cancelled()
    request._cancelled = True
    assert sender.is_cancelled()


def test_response_sender_checks_its_arguments_with_tritons_messages() -> None:
    sender = pb_utils.InferenceResponseSender(bls_request(), lambda r, f: None)
    with pytest.raises(pb_utils.TritonModelException) as refused:
        sender.send(None, flags=0)
    assert refused.value.message() == (
        "Inference Response object must be provided when the response flags is set to zero."
    )
    with pytest.raises(pb_utils.TritonModelException) as refused:
        sender.send(pb_utils.InferenceResponse(), flags=7)
    assert refused.value.message() == "Unable to send response. Unsupported flag provided."


def test_response_sender_of_a_model_that_is_not_decoupled_sends_one_response() -> None:
    """Triton's rules (python_backend's response_sender.cc), checked before anything goes
    out; ``on_refused`` hears each refusal."""
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    sent: list[tuple[object, int]] = []
    refused: list[str] = []

    def sender() -> pb_utils.InferenceResponseSender:
        sent.clear()
        return pb_utils.InferenceResponseSender(
            bls_request(), lambda r, f: sent.append((r, f)), decoupled=False,
            on_refused=lambda exc: refused.append(exc.message()),
        )  # fmt: skip

    response = pb_utils.InferenceResponse()
    first = sender()
    with pytest.raises(pb_utils.TritonModelException, match="cannot send complete final before"):
        first.send(flags=final)
    first.send(response)
    with pytest.raises(pb_utils.TritonModelException, match="cannot send more than one response"):
        first.send(response, flags=final)
    first.send(flags=final)  # the final flag after the response
    with pytest.raises(pb_utils.TritonModelException, match="Response sender has been closed"):
        first.send(flags=final)
    assert sent == [(response, 0), (None, final)] and first.closed
    assert refused == [
        "Unable to send response. Non-decoupled model cannot send complete final before "
        "sending a response.",
        "Unable to send response. Non-decoupled model cannot send more than one response.",
        "Unable to send response. Response sender has been closed.",
    ]
    returned = sender()
    returned._count_returned()  # execute returned this request's response
    with pytest.raises(pb_utils.TritonModelException, match="cannot send more than one response"):
        returned.send(response)
    assert sent == []


def test_response_with_outputs_and_parameters() -> None:
    out = pb_utils.Tensor("OUTPUT0", np.ones(1, np.int32))
    response = pb_utils.InferenceResponse(output_tensors=[out], parameters={"k": "v"})
    assert response.output_tensors() == [out]
    assert not response.has_error()
    assert response.error() is None
    assert json.loads(response.parameters()) == {"k": "v"}
    assert pb_utils.get_output_tensor_by_name(response, "OUTPUT0") is out
    assert pb_utils.get_output_tensor_by_name(response, "OTHER") is None


def test_response_with_error() -> None:
    error = pb_utils.TritonError("missing", pb_utils.TritonError.NOT_FOUND)
    response = pb_utils.InferenceResponse(error=error)
    assert response.has_error()
    assert response.error() is error
    assert response.output_tensors() == []


def test_response_refusals() -> None:
    """As pybind11 refuses arguments of the wrong type in Triton: TypeError."""
    incompatible = "incompatible constructor arguments"
    with pytest.raises(TypeError, match=incompatible):
        pb_utils.InferenceResponse(output_tensors="OUTPUT0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=incompatible):
        pb_utils.InferenceResponse(output_tensors=[np.zeros(1)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=incompatible):
        pb_utils.InferenceResponse(error=ValueError("x"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value", "code"),
    [
        ("UNKNOWN", 0, ErrorCode.UNKNOWN),
        ("INTERNAL", 1, ErrorCode.INTERNAL),
        ("NOT_FOUND", 2, ErrorCode.NOT_FOUND),
        ("INVALID_ARG", 3, ErrorCode.INVALID_ARG),
        ("UNAVAILABLE", 4, ErrorCode.UNAVAILABLE),
        ("UNSUPPORTED", 5, ErrorCode.UNSUPPORTED),
        ("ALREADY_EXISTS", 6, ErrorCode.ALREADY_EXISTS),
        ("CANCELLED", 7, ErrorCode.CANCELLED),
    ],
)
def test_triton_error_codes_are_tritons(name: str, value: int, code: ErrorCode) -> None:
    assert getattr(pb_utils.TritonError, name) == value  # TRITONSERVER_Error_Code values
    error = pb_utils.TritonError("m", value)
    assert (error.code(), error.message(), str(error)) == (value, "m", "m")
    assert error.error_code() == code


def test_triton_error_defaults_to_internal_and_checks_its_code() -> None:
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    with pytest.raises(TypeError):
        pb_utils.TritonError("x", 42)


def test_triton_model_exception_message() -> None:
    exc = pb_utils.TritonModelException("went wrong")
    assert (str(exc), exc.message()) == ("went wrong", "went wrong")
