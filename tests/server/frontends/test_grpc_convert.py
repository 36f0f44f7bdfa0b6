"""gRPC converters, bytes in and out: requests as tritonclient serializes them, responses
as tritonclient parses them."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, cast

import grpc
import ml_dtypes
import numpy as np
import pytest
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc._utils import _get_inference_request

from dlserve import errors
from dlserve.server.core.service import InferenceService
from dlserve.server.core.telemetry.trace_settings import TraceSettings
from dlserve.server.frontends.grpc import control, convert, health
from dlserve.server.frontends.grpc.servicer import GrpcServicer, create_grpc_server
from dlserve.server.frontends.grpc.status_codes import STATUS_CODES, status_of
from dlserve.server.transport.grpc.status import RpcError
from dlserve.server.transport.listen_error import ListenError
from dlserve.types import (
    BatchStats,
    DurationStat,
    InferenceStats,
    InferResponse,
    ModelMetadata,
    ModelState,
    ModelStatistics,
    OutputTensor,
    RepositoryEntry,
    ServerMetadata,
    TensorMetadata,
)


def client_request(*arrays: tuple[str, Any], **kwargs: Any) -> bytes:
    """A ModelInferRequest serialized exactly as tritonclient.grpc builds it."""
    inputs = []
    for name, array in arrays:
        if array.dtype == ml_dtypes.bfloat16:
            datatype = "BF16"
        elif array.dtype == object:
            datatype = "BYTES"
        else:
            datatype = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64",
                        np.dtype(np.bool_): "BOOL"}[array.dtype]  # fmt: skip
        tensor = InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    options: dict[str, Any] = {
        "model_version": "", "request_id": "", "outputs": None, "sequence_id": 0,
        "sequence_start": False, "sequence_end": False, "priority": 0, "timeout": None,
        "parameters": None,
    }  # fmt: skip
    options.update(kwargs)
    message = _get_inference_request(model_name="m", inputs=inputs, **options)
    return bytes(message.SerializeToString())


# -- error table -----------------------------------------------------------------------
def test_every_error_code_has_a_grpc_status() -> None:
    assert set(STATUS_CODES) == set(errors.ErrorCode)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (errors.ErrorCode.INTERNAL, grpc.StatusCode.INTERNAL),
        (errors.ErrorCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
        (errors.ErrorCode.INVALID_ARG, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
        (errors.ErrorCode.UNSUPPORTED, grpc.StatusCode.UNIMPLEMENTED),
        (errors.ErrorCode.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS),
        (errors.ErrorCode.CANCELLED, grpc.StatusCode.CANCELLED),
        (errors.ErrorCode.UNKNOWN, grpc.StatusCode.UNKNOWN),
        (errors.ErrorCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
def test_status_codes_follow_triton(code: errors.ErrorCode, status: grpc.StatusCode) -> None:
    assert STATUS_CODES[code] == status


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (errors.NotFoundError("no model"), (grpc.StatusCode.NOT_FOUND, "no model")),
        (errors.ModelError("bad", errors.ErrorCode.INVALID_ARG),
         (grpc.StatusCode.INVALID_ARGUMENT, "bad")),
        (RpcError(grpc.StatusCode.UNIMPLEMENTED, "no such"),
         (grpc.StatusCode.UNIMPLEMENTED, "no such")),
        (ValueError("broken"), (grpc.StatusCode.INTERNAL, "broken")),
        (KeyError(), (grpc.StatusCode.INTERNAL, "KeyError")),
    ],
)  # fmt: skip
def test_failures_end_calls_with_their_status(
    exc: Exception, expected: tuple[grpc.StatusCode, str]
) -> None:
    assert status_of(exc) == (expected[0].value[0], expected[1])


# -- requests --------------------------------------------------------------------------
def test_raw_inputs_are_views_of_the_received_bytes() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[7, -8]], dtype=np.int64)
    data = client_request(("A", a), ("B", b), request_id="r1", model_version="3")
    request = convert.parse_infer_request(data)
    assert (request.model_name, request.model_version, request.id) == ("m", "3", "r1")
    assert [(t.name, t.datatype, t.shape) for t in request.inputs] == [
        ("A", "FP32", (2, 3)),
        ("B", "INT64", (1, 2)),
    ]
    for tensor, array in zip(request.inputs, (a, b), strict=True):
        assert tensor.data is not None
        assert tensor.data.obj is data  # no copy: a view of what gRPC handed over
        assert bytes(tensor.data) == array.tobytes()
    assert request.outputs == []
    assert request.parameters == {}


def test_raw_inputs_anywhere_in_the_message() -> None:
    """Protobuf may interleave fields; concatenated messages merge their repeated fields."""
    first = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\x01\x02"])
    second = pb.ModelInferRequest(
        inputs=[pb.ModelInferRequest.InferInputTensor(name=n, datatype="UINT8", shape=[2])
                for n in ("X", "Y")],
        raw_input_contents=[b"\x03\x04"], id="later",
    )  # fmt: skip
    data = first.SerializeToString() + second.SerializeToString()
    request = convert.parse_infer_request(data)
    assert [bytes(t.data or b"") for t in request.inputs] == [b"\x01\x02", b"\x03\x04"]
    assert (request.model_name, request.id) == ("m", "later")


def test_large_raw_input_is_not_copied() -> None:
    payload = np.random.default_rng(0).random(1 << 18, dtype=np.float32)
    data = client_request(("A", payload))
    (tensor,) = convert.parse_infer_request(data).inputs
    assert tensor.data is not None and tensor.data.obj is data
    assert np.array_equal(np.frombuffer(tensor.data, np.float32), payload)


def test_bytes_and_bf16_raw_inputs() -> None:
    text = np.array([b"hello", b"", "w\u00f6rld".encode()], dtype=object)
    bf16 = np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16)
    request = convert.parse_infer_request(client_request(("S", text), ("H", bf16)))
    s, h = request.inputs
    assert s.datatype == "BYTES" and h.datatype == "BF16"
    assert bytes(s.data or b"") == b"\x05\0\0\0hello\0\0\0\0\x06\0\0\0w\xc3\xb6rld"
    assert bytes(h.data or b"") == bf16.view(np.uint16).tobytes()


def test_request_parameters_of_every_kind() -> None:
    data = client_request(
        ("A", np.zeros(1, np.float32)), sequence_id=42, sequence_start=True, priority=7,
        timeout=1000, parameters={"s": "v", "f": 0.5, "i": -3, "b": False},
    )  # fmt: skip
    request = convert.parse_infer_request(data)
    assert request.parameters == {
        "sequence_id": 42, "sequence_start": True, "sequence_end": False, "priority": 7,
        "timeout": 1000, "s": "v", "f": 0.5, "i": -3, "b": False,
    }  # fmt: skip
    assert isinstance(request.parameters["b"], bool)


def test_unset_parameter_is_invalid() -> None:
    message = pb.ModelInferRequest(model_name="m")
    message.parameters["empty"].SetInParent()
    with pytest.raises(errors.InvalidArgumentError, match="'empty' parameter"):
        convert.parse_infer_request(message.SerializeToString())


def test_requested_outputs_and_their_parameters() -> None:
    outputs = [InferRequestedOutput("O0"), InferRequestedOutput("O1", class_count=3)]
    request = convert.parse_infer_request(
        client_request(("A", np.zeros(1, np.float32)), outputs=outputs)
    )
    assert [(o.name, o.parameters) for o in request.outputs] == [
        ("O0", {}),
        ("O1", {"classification": 3}),
    ]


def _typed(datatype: str, field: str, values: list[Any], shape: list[int]) -> bytes:
    tensor = pb.ModelInferRequest.InferInputTensor(name="T", datatype=datatype, shape=shape)
    getattr(tensor.contents, field).extend(values)
    return bytes(pb.ModelInferRequest(model_name="m", inputs=[tensor]).SerializeToString())


@pytest.mark.parametrize(
    ("datatype", "field", "values", "expected"),
    [
        ("BOOL", "bool_contents", [True, False], np.array([True, False])),
        ("INT8", "int_contents", [-1, 127], np.array([-1, 127], np.int8)),
        ("INT16", "int_contents", [-300, 2], np.array([-300, 2], np.int16)),
        ("INT32", "int_contents", [-70000, 1], np.array([-70000, 1], np.int32)),
        ("INT64", "int64_contents", [-(2**40), 5], np.array([-(2**40), 5], np.int64)),
        ("UINT8", "uint_contents", [255, 0], np.array([255, 0], np.uint8)),
        ("UINT16", "uint_contents", [65535, 1], np.array([65535, 1], np.uint16)),
        ("UINT32", "uint_contents", [2**32 - 1, 1], np.array([2**32 - 1, 1], np.uint32)),
        ("UINT64", "uint64_contents", [2**64 - 1, 0], np.array([2**64 - 1, 0], np.uint64)),
        ("FP32", "fp32_contents", [1.5, -2.0], np.array([1.5, -2.0], np.float32)),
        ("FP64", "fp64_contents", [1e300, -0.5], np.array([1e300, -0.5], np.float64)),
    ],
)
def test_typed_contents_become_raw_bytes(
    datatype: str, field: str, values: list[Any], expected: Any
) -> None:
    (tensor,) = convert.parse_infer_request(_typed(datatype, field, values, [2])).inputs
    assert (tensor.datatype, tensor.shape) == (datatype, (2,))
    assert bytes(tensor.data or b"") == expected.tobytes()


def test_typed_bytes_contents_are_length_prefixed() -> None:
    (tensor,) = convert.parse_infer_request(
        _typed("BYTES", "bytes_contents", [b"ab", b""], [2])
    ).inputs
    assert bytes(tensor.data or b"") == b"\x02\0\0\0ab\0\0\0\0"


def test_empty_typed_contents_are_an_empty_tensor() -> None:
    (tensor,) = convert.parse_infer_request(_typed("FP32", "fp32_contents", [], [0])).inputs
    assert tensor.data is not None and tensor.data.nbytes == 0


def test_typed_contents_of_the_wrong_type() -> None:
    with pytest.raises(errors.InvalidArgumentError) as info:
        convert.parse_infer_request(_typed("FP16", "fp32_contents", [1.0], [1]))
    assert str(info.value) == (
        "unexpected explicit tensor data for input tensor 'T' for model 'm' of type 'FP32', "
        "expected datatype 'FP16'"
    )


def test_two_typed_contents_fields() -> None:
    tensor = pb.ModelInferRequest.InferInputTensor(name="T", datatype="INT32", shape=[1])
    tensor.contents.int_contents.append(1)
    tensor.contents.fp32_contents.append(1.0)
    data = pb.ModelInferRequest(model_name="m", inputs=[tensor]).SerializeToString()
    with pytest.raises(errors.InvalidArgumentError, match="binary data was already supplied"):
        convert.parse_infer_request(data)


def test_typed_contents_with_raw_contents() -> None:
    tensor = pb.ModelInferRequest.InferInputTensor(name="T", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(1.0)
    message = pb.ModelInferRequest(model_name="m", inputs=[tensor], raw_input_contents=[b"x"])
    with pytest.raises(errors.InvalidArgumentError) as info:
        convert.parse_infer_request(message.SerializeToString())
    assert str(info.value) == (
        "contents field must not be specified when using raw_input_contents for 'T' for model 'm'"
    )


def test_fewer_raw_contents_than_inputs() -> None:
    a = np.zeros(2, np.float32)
    message = pb.ModelInferRequest.FromString(client_request(("A", a), ("B", a)))
    del message.raw_input_contents[1]
    with pytest.raises(errors.InvalidArgumentError) as info:
        convert.parse_infer_request(message.SerializeToString())
    assert str(info.value) == "unable to find data for input tensor 'B' for model 'm' in request."


def test_more_raw_contents_than_inputs() -> None:
    message = pb.ModelInferRequest.FromString(client_request(("A", np.zeros(2, np.float32))))
    message.raw_input_contents.append(b"extra")
    with pytest.raises(errors.InvalidArgumentError, match="expected 1 raw_input_contents"):
        convert.parse_infer_request(message.SerializeToString())


@pytest.mark.parametrize(
    "data",
    [
        b"\x3a\x05ab",  # raw contents longer than the message
        b"\x3a",  # key without a length
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # endless varint
        b"\x0b\x0c",  # group wire type
        b"\x0a\x03abc\x12\x80",  # a string, then a truncated one
    ],
)
def test_malformed_requests_are_invalid_arguments(data: bytes) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="malformed ModelInferRequest"):
        convert.parse_infer_request(data)
    assert convert.request_id_of(data) == ""


def test_request_id_of_a_request_that_fails_to_convert() -> None:
    message = pb.ModelInferRequest(model_name="m", id="abc")
    message.inputs.add(name="A", datatype="FP32", shape=[1])
    assert convert.request_id_of(message.SerializeToString()) == "abc"


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32, 2**63, 2**64 - 1])
def test_varint_round_trip(value: int) -> None:
    encoded = convert.encode_varint(value)
    message = pb.StatisticDuration.FromString(b"\x08" + encoded)  # field 1, varint
    assert message.count == value


# -- responses -------------------------------------------------------------------------
def _response() -> InferResponse:
    floats = np.array([[1.5, -2.0]], np.float32)
    text = np.array([b"x", b"yz"], dtype=object)
    serialized = b"\x01\0\0\0x\x02\0\0\0yz"
    return InferResponse(
        "m", "2", "req-9",
        [
            OutputTensor("F", "FP32", (1, 2), memoryview(floats).cast("B")),
            OutputTensor("S", "BYTES", text.shape, serialized, {"note": "p"}),
            OutputTensor("R", "FP32", (4,), None),
        ],
        {"flag": True, "count": 3, "big": 2**64 - 1, "ratio": 0.25, "name": "n"},
    )  # fmt: skip


def test_infer_response_as_tritonclient_reads_it() -> None:
    data = convert.serialize_infer_response(_response())
    message = pb.ModelInferResponse.FromString(data)
    assert (message.model_name, message.model_version, message.id) == ("m", "2", "req-9")
    assert [(o.name, o.datatype, list(o.shape)) for o in message.outputs] == [
        ("F", "FP32", [1, 2]),
        ("S", "BYTES", [2]),
        ("R", "FP32", [4]),
    ]
    assert list(message.raw_output_contents) == [
        np.array([[1.5, -2.0]], np.float32).tobytes(),
        b"\x01\0\0\0x\x02\0\0\0yz",
        b"",
    ]
    result = InferResult(message)
    assert np.array_equal(result.as_numpy("F"), [[1.5, -2.0]])
    assert list(result.as_numpy("S")) == [b"x", b"yz"]
    params = message.parameters
    assert params["flag"].bool_param is True
    assert params["count"].int64_param == 3
    assert params["big"].uint64_param == 2**64 - 1
    assert params["ratio"].double_param == 0.25
    assert params["name"].string_param == "n"
    assert message.outputs[1].parameters["note"].string_param == "p"


def test_large_output_round_trip() -> None:
    values = np.arange(1 << 20, dtype=np.float32)
    response = InferResponse(
        "m", "1", "", [OutputTensor("O", "FP32", values.shape, memoryview(values).cast("B"))]
    )
    message = pb.ModelInferResponse.FromString(convert.serialize_infer_response(response))
    assert np.array_equal(InferResult(message).as_numpy("O"), values)


def test_stream_response_wraps_the_infer_response() -> None:
    message = pb.ModelStreamInferResponse.FromString(convert.serialize_stream_response(_response()))
    assert message.error_message == ""
    expected = pb.ModelInferResponse.FromString(convert.serialize_infer_response(_response()))
    assert message.infer_response == expected


def test_stream_error_keeps_the_request_id() -> None:
    message = pb.ModelStreamInferResponse.FromString(convert.serialize_stream_error("bad", "r7"))
    assert message.error_message == "bad"
    assert message.infer_response.id == "r7"


# -- metadata, statistics, repository --------------------------------------------------
def test_metadata_responses() -> None:
    server = control.server_metadata_response(ServerMetadata("dlserve", "0.1", ("a", "b")))
    assert (server.name, server.version, list(server.extensions)) == ("dlserve", "0.1", ["a", "b"])
    model = control.model_metadata_response(ModelMetadata(
        "add", ("1", "2"), "python", (TensorMetadata("I", "FP32", (-1, 4)),),
        (TensorMetadata("O", "BYTES", (1,)),),
    ))  # fmt: skip
    assert (model.name, list(model.versions), model.platform) == ("add", ["1", "2"], "python")
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [("I", "FP32", [-1, 4])]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [("O", "BYTES", [1])]


def test_statistics_response() -> None:
    d = DurationStat
    stats = ModelStatistics(
        "m", "1", 1234, 10, 4,
        InferenceStats(d(4, 100), d(1, 5), d(4, 10), d(4, 20), d(4, 30), d(4, 40)),
        (BatchStats(2, d(2, 7), d(2, 8), d(2, 9)),),
    )  # fmt: skip
    (message,) = control.statistics_response([stats]).model_stats
    assert (message.name, message.version, message.last_inference) == ("m", "1", 1234)
    assert (message.inference_count, message.execution_count) == (10, 4)
    infer = message.inference_stats
    assert [(s.count, s.ns) for s in (infer.success, infer.fail, infer.queue,
            infer.compute_input, infer.compute_infer, infer.compute_output)] == [
        (4, 100), (1, 5), (4, 10), (4, 20), (4, 30), (4, 40)]  # fmt: skip
    (batch,) = message.batch_stats
    assert batch.batch_size == 2
    assert (batch.compute_input.ns, batch.compute_infer.ns, batch.compute_output.ns) == (7, 8, 9)


def test_repository_index_response() -> None:
    message = control.repository_index_response([
        RepositoryEntry("a", "1", ModelState.READY, ""),
        RepositoryEntry("b", "", None, ""),
        RepositoryEntry("c", "2", ModelState.UNAVAILABLE, "load failed"),
    ])  # fmt: skip
    assert [(m.name, m.version, m.state, m.reason) for m in message.models] == [
        ("a", "1", "READY", ""),
        ("b", "", "", ""),
        ("c", "2", "UNAVAILABLE", "load failed"),
    ]


# -- repository control, log and trace settings ----------------------------------------
def _load(params: dict[str, Any], repository: str = "") -> Any:
    request = pb.RepositoryModelLoadRequest(model_name="m", repository_name=repository)
    for key, (kind, value) in params.items():
        setattr(request.parameters[key], kind, value)
    return request


def test_load_parameters() -> None:
    assert control.load_parameters(_load({})) == (None, {})
    config = '{"max_batch_size": 4}'
    assert control.load_parameters(_load({"config": ("string_param", config)})) == (config, {})
    files = _load({"config": ("string_param", config), "file:1/model.py": ("bytes_param", b"x")})
    assert control.load_parameters(files) == (config, {"file:1/model.py": b"x"})


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (_load({"config": ("bool_param", True)}), errors.InvalidArgumentError,
         "invalid value type for load parameter 'config', expected string_param."),
        (_load({"file:1/model.py": ("string_param", "x")}), errors.InvalidArgumentError,
         "invalid value type for load parameter 'file:1/model.py', expected bytes_param."),
        (_load({"other": ("int64_param", 1)}), errors.InvalidArgumentError,
         "unrecognized load parameter 'other'."),
        (_load({}, repository="r"), errors.UnsupportedError,
         "'repository_name' specification is not supported"),
    ],
)  # fmt: skip
def test_load_parameters_rejected(request_: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        control.load_parameters(request_)
    assert str(info.value).startswith(message)


def test_unload_parameters() -> None:
    request = pb.RepositoryModelUnloadRequest(model_name="m")
    request.parameters["unload_dependents"].bool_param = True
    control.check_unload_request(request)
    request.parameters["unload_dependents"].string_param = "yes"
    with pytest.raises(errors.InvalidArgumentError, match="unload_dependents"):
        control.check_unload_request(request)


def _log(**settings: tuple[str, Any]) -> Any:
    request = pb.LogSettingsRequest()
    for key, (kind, value) in settings.items():
        setattr(request.settings[key], kind, value)
    return request


def test_log_settings_update() -> None:
    request = _log(log_info=("bool_param", False), log_verbose_level=("uint32_param", 2),
                   log_format=("string_param", "ISO8601"))  # fmt: skip
    assert control.log_settings_update(request) == {
        "log_info": False,
        "log_verbose_level": 2,
        "log_format": "ISO8601",
    }


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (_log(log_file=("string_param", "/tmp/x")), errors.UnsupportedError,
         "log file location can not be updated through network protocol"),
        (_log(log_info=("uint32_param", 1)), errors.InvalidArgumentError,
         "expect boolean for 'log_info'"),
        (_log(log_verbose_level=("bool_param", True)), errors.InvalidArgumentError,
         "expect int32 for 'log_verbose_level'"),
        (_log(log_format=("string_param", "fancy")), errors.InvalidArgumentError,
         "invalid argument for log_format, got: fancy"),
    ],
)  # fmt: skip
def test_log_settings_rejected(request_: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        control.log_settings_update(request_)
    assert str(info.value) == message


def test_log_settings_response() -> None:
    message = control.log_settings_response(
        {"log_file": "", "log_info": True, "log_verbose_level": 1, "log_format": "default"}
    )
    s = message.settings
    assert (s["log_file"].string_param, s["log_info"].bool_param) == ("", True)
    assert (s["log_verbose_level"].uint32_param, s["log_format"].string_param) == (1, "default")
    assert s["log_info"].WhichOneof("parameter_choice") == "bool_param"


def test_trace_settings_round_trip() -> None:
    request = pb.TraceSettingRequest(model_name="m")
    request.settings["trace_rate"].value.append("5")
    request.settings["trace_level"].value.extend(["TIMESTAMPS", "TENSORS"])
    updates = control.trace_settings_update(request)
    assert updates == {"trace_rate": ["5"], "trace_level": ["TIMESTAMPS", "TENSORS"]}
    response = control.trace_settings_response(updates)
    assert list(response.settings["trace_level"].value) == ["TIMESTAMPS", "TENSORS"]


def test_trace_settings_per_model_and_cleared() -> None:
    trace = TraceSettings()
    assert trace.get()["trace_level"] == ["OFF"]
    trace.update("m", {"trace_rate": ["7"]})
    trace.update("", {"trace_count": ["10"]})
    assert (trace.get("m")["trace_rate"], trace.get("m")["trace_count"]) == (["7"], ["10"])
    assert trace.get()["trace_rate"] == ["1000"]
    trace.update("m", {"trace_rate": []})
    assert trace.get("m")["trace_rate"] == ["1000"]
    trace.update("", {"trace_count": []})
    assert trace.get()["trace_count"] == ["-1"]


@pytest.mark.parametrize(
    ("updates", "error"),
    [
        ({"trace_file": ["/x"]}, errors.UnsupportedError),
        ({"trace_level": ["OFF", "TENSORS"]}, errors.InvalidArgumentError),
        ({"trace_level": ["LOUD"]}, errors.InvalidArgumentError),
        ({"trace_rate": ["1", "2"]}, errors.InvalidArgumentError),
        ({"trace_rate": ["fast"]}, errors.InvalidArgumentError),
        ({"trace_count": ["-2"]}, errors.InvalidArgumentError),
    ],
)
def test_trace_settings_rejected(updates: dict[str, list[str]], error: type[Exception]) -> None:
    trace = TraceSettings()
    with pytest.raises(error):
        trace.update("", {"trace_rate": ["3"], **updates})
    assert trace.get()["trace_rate"] == ["1000"]  # all or nothing


# -- the server factory ----------------------------------------------------------------
def test_server_binds_a_free_port_and_refuses_a_taken_one() -> None:
    unused = cast(InferenceService, SimpleNamespace(trace=TraceSettings()))  # never called

    async def bind_twice() -> int:
        server = create_grpc_server(unused, "127.0.0.1", 0)
        port = await server.start()
        try:
            with pytest.raises(ListenError, match=f"127.0.0.1:{port}"):
                await create_grpc_server(unused, "127.0.0.1", port).start()
        finally:
            await server.stop(None)
        return port

    assert asyncio.run(bind_twice()) > 0


def test_health_check_says_not_serving_while_the_server_is_not_ready() -> None:
    class Readiness:
        ready_now = False

        def ready(self) -> bool:
            return self.ready_now

    readiness = Readiness()
    servicer = GrpcServicer(cast(InferenceService, readiness))
    check = health.HealthCheckRequest()
    assert asyncio.run(servicer.health_check(check, None)).status == health.NOT_SERVING
    readiness.ready_now = True
    assert asyncio.run(servicer.health_check(check, None)).status == health.SERVING


# -- the walk is bounded by a ModelInferRequest's real structure -------------------------------
@pytest.mark.parametrize(
    ("data", "what"),
    [
        (bytes(64 << 20), "field number 0 at byte 0"),  # 64 MiB of zeros: refused at once
        (b"\x0a\x01m\x00\x00", "field number 0 at byte 3"),
        (b"\x08\x01", "field 1 with wire type 0 (it is length-delimited)"),
        (b"\x0a\x01m\x3d\x00\x00\x00\x00", "field 7 with wire type 5 (it is length-delimited)"),
        (b"\x42\x00", "unknown field 8 at byte 0"),
        (b"\x8a\x00\x00", "field 1 with wire type 2"),  # a key written in two bytes
        (b"\xfa\xff\x03\x00", "unknown field 8191 at byte 0"),
    ],
)  # fmt: skip
def test_what_is_not_a_field_of_the_message_is_refused_where_it_starts(
    data: bytes, what: str
) -> None:
    started = time.perf_counter()
    with pytest.raises(errors.InvalidArgumentError, match="malformed ModelInferRequest: ") as info:
        convert.parse_infer_request(data)
    assert what in str(info.value)
    assert time.perf_counter() - started < 0.01


@pytest.mark.parametrize("key", [b"\x3a", b"\x2a", b"\x32", b"\x22"])
def test_millions_of_tiny_fields_cost_max_fields_steps(key: bytes) -> None:
    """10 million empty raw_input_contents (or inputs, outputs, parameters) are refused
    after max_fields fields, in about a millisecond."""
    data = (key + b"\x00") * 10_000_000
    started = time.perf_counter()
    with pytest.raises(errors.InvalidArgumentError, match="more than 4096 fields"):
        convert.parse_infer_request(data)
    assert time.perf_counter() - started < 0.05
    with pytest.raises(errors.InvalidArgumentError, match="more than 10 fields"):
        convert.split_infer_request((key + b"\x00") * 11, max_fields=10)
    convert.split_infer_request((key + b"\x00") * 10, max_fields=10)  # at the bound: read


def test_the_server_walks_thousands_of_fields_in_turns_of_the_loop() -> None:
    """4096 tiny fields (about two milliseconds of walking) go 256 fields a turn: the loop
    turns between (another task ticks 15 times), and the split is the same as in one go."""
    data = b"\x0a\x01m" + b"\x3a\x00" * 4095

    async def scenario() -> int:
        loop, turns = asyncio.get_running_loop(), []

        def turn() -> None:  # once a turn of the loop
            turns.append(None)
            loop.call_soon(turn)

        loop.call_soon(turn)
        metadata, raws = await convert.split_in_turns(data)
        assert (bytes(metadata), [bytes(raw) for raw in raws]) == (b"\x0a\x01m", [b""] * 4095)
        return len(turns)

    assert asyncio.run(scenario()) >= 15
    with pytest.raises(errors.InvalidArgumentError, match="more than 4096 fields"):
        asyncio.run(convert.split_in_turns(data + b"\x3a\x00"))


def test_a_look_at_an_arriving_message_walks_64_fields_at_most() -> None:
    """A piece of 8192 tiny fields is walked 64 fields a look: the 65th look, with 4096
    walked, refuses it (and so does the first look when the bound is reached sooner)."""
    view = memoryview(b"\x3a\x00" * 8192)
    screen = convert.ArrivingRequest()
    for _ in range(64):
        screen(view, len(view))
    with pytest.raises(errors.InvalidArgumentError, match="more than 4096 fields"):
        screen(view, len(view))
    with pytest.raises(errors.InvalidArgumentError, match="more than 10 fields"):
        convert.ArrivingRequest(max_fields=10)(view, len(view))
