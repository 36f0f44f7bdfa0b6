"""The gRPC frontend driven by unmodified tritonclient.grpc against a real server."""

from __future__ import annotations

import json
import queue
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import EXAMPLES, RunningServer, run_server

RNG = np.random.default_rng(7)
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def client(example_server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(example_server.grpc_url) as c:
        yield c


@pytest.fixture(scope="module")
def explicit_server() -> Iterator[RunningServer]:
    """A private server (explicit control mode) for tests that change server state."""
    with run_server(
        EXAMPLES, "--model-control-mode", "explicit", "--load-model", "add_sub"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def explicit_client(explicit_server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(explicit_server.grpc_url) as c:
        yield c


def tensor(name: str, array: Any, datatype: str | None = None) -> grpcclient.InferInput:
    if datatype is None:
        datatype = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32"}[array.dtype]
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def add_sub_inputs(n: int = 16) -> tuple[list[grpcclient.InferInput], Any, Any]:
    a = RNG.standard_normal(n).astype(np.float32)
    b = RNG.standard_normal(n).astype(np.float32)
    return [tensor("INPUT0", a), tensor("INPUT1", b)], a, b


def check_add_sub(client: grpcclient.InferenceServerClient, n: int = 16) -> None:
    inputs, a, b = add_sub_inputs(n)
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def raises_status(status: str, call: Any, *args: Any, **kwargs: Any) -> str:
    """Call, expect an InferenceServerException with this gRPC status; its message."""
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    assert info.value.status() == f"StatusCode.{status}", info.value.message()
    return str(info.value.message())


# -- health and metadata ---------------------------------------------------------------
def test_live_and_ready(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()


def test_grpc_health_checking_protocol(example_server: RunningServer) -> None:
    """grpc.health.v1.Health/Check, as Kubernetes' gRPC probes call it: SERVING (field 1
    = 1 on the wire) while the server is ready, whatever service is named; no Watch."""
    with grpc.insecure_channel(example_server.grpc_url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(b"", timeout=DEADLINE_S) == b"\x08\x01"
        assert check(b"\x0a\x09inference", timeout=DEADLINE_S) == b"\x08\x01"
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        with pytest.raises(grpc.RpcError) as info:
            list(watch(b"", timeout=DEADLINE_S))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_model_ready(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "99")
    assert not client.is_model_ready("no_such_model")


def test_server_metadata(client: grpcclient.InferenceServerClient) -> None:
    metadata = client.get_server_metadata()
    assert metadata.name == "dlserve"
    assert metadata.version
    assert {"model_repository", "statistics", "model_configuration"} <= set(metadata.extensions)


def test_model_metadata(client: grpcclient.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("add_sub")
    assert (metadata.name, list(metadata.versions), metadata.platform) == (
        "add_sub",
        ["1"],
        "python",
    )
    expected = [("INPUT0", "FP32", [-1]), ("INPUT1", "FP32", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == expected
    outputs = [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs]
    assert outputs == [("OUTPUT0", "FP32", [-1]), ("OUTPUT1", "FP32", [-1])]


def test_model_config(client: grpcclient.InferenceServerClient) -> None:
    config = client.get_model_config("add_sub").config
    assert (config.name, config.backend, config.max_batch_size) == ("add_sub", "python", 0)
    assert [i.name for i in config.input] == ["INPUT0", "INPUT1"]
    assert [o.name for o in config.output] == ["OUTPUT0", "OUTPUT1"]


@pytest.mark.parametrize("call", ["get_model_metadata", "get_model_config"])
def test_metadata_of_unknown_model(client: grpcclient.InferenceServerClient, call: str) -> None:
    message = raises_status("NOT_FOUND", getattr(client, call), "no_such_model")
    assert "no_such_model" in message


# -- inference -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 1000, 2 * 1024 * 1024])  # the last: 8 MiB per tensor
def test_add_sub_any_length(client: grpcclient.InferenceServerClient, n: int) -> None:
    check_add_sub(client, n)


def test_infer_echoes_id_and_version(client: grpcclient.InferenceServerClient) -> None:
    inputs, _, _ = add_sub_inputs()
    response = client.infer("add_sub", inputs, request_id="req-42", model_version="1")
    message = response.get_response()
    assert (message.id, message.model_name, message.model_version) == ("req-42", "add_sub", "1")
    assert [(o.name, o.datatype, list(o.shape)) for o in message.outputs] == [
        ("OUTPUT0", "FP32", [16]),
        ("OUTPUT1", "FP32", [16]),
    ]
    assert len(message.raw_output_contents) == 2


def test_requested_output_only(client: grpcclient.InferenceServerClient) -> None:
    inputs, a, b = add_sub_inputs()
    outputs = [grpcclient.InferRequestedOutput("OUTPUT1")]
    result = client.infer("add_sub", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None


def test_typed_contents_instead_of_raw(example_server: RunningServer) -> None:
    """tritonclient always sends raw contents; its generated stub can send typed ones."""
    request = service_pb2.ModelInferRequest(model_name="add_sub", id="typed")
    for name, values in (("INPUT0", [1.0, 2.0, 3.5]), ("INPUT1", [0.5, 0.25, -1.0])):
        request.inputs.add(name=name, datatype="FP32", shape=[3]).contents.fp32_contents.extend(
            values
        )
    with grpc.insecure_channel(example_server.grpc_url) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    result = grpcclient.InferResult(response)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [1.5, 2.25, 2.5])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), [0.5, 1.75, 4.5])


def test_stream_infer(client: grpcclient.InferenceServerClient) -> None:
    """Responses come back in order; a failed request answers with an error, the stream goes on."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    expected = []
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for index in range(8):
            inputs, a, b = add_sub_inputs(index + 1)
            expected.append((a + b, a - b))
            if index == 3:
                bad = [*inputs, tensor("EXTRA", a)]
                client.async_stream_infer("add_sub", bad, request_id="bad")
            client.async_stream_infer("add_sub", inputs, request_id=str(index))
        received = [results.get(timeout=DEADLINE_S) for _ in range(9)]
    finally:
        client.stop_stream()
    errors = [error for result, error in received if error is not None]
    assert len(errors) == 1  # one input too many: Triton counts them first
    assert "expected 2 inputs but got 3 inputs for model 'add_sub'" in errors[0].message()
    good = [result for result, error in received if error is None]
    assert [r.get_response().id for r in good] == [str(i) for i in range(8)]
    for result, (total, difference) in zip(good, expected, strict=True):
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), total)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), difference)


def test_stream_error_for_unknown_model(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        inputs, _, _ = add_sub_inputs()
        client.async_stream_infer("no_such_model", inputs, request_id="lost")
        client.async_stream_infer("add_sub", inputs, request_id="found")
        (_, error), (result, ok) = (results.get(timeout=DEADLINE_S) for _ in range(2))
    finally:
        client.stop_stream()
    assert error is not None and "no_such_model" in error.message()
    assert ok is None and result.get_response().id == "found"


# -- identity models, one per data type ------------------------------------------------
def _values(datatype: str, shape: list[int]) -> Any:
    if datatype == "BYTES":
        pool = [b"", b"a", b"\x00\xff\x00", "w\u00f6rld".encode(), b"x" * 300]
        flat = [pool[i % len(pool)] for i in range(int(np.prod(shape)))]
        return np.array(flat, dtype=object).reshape(shape)
    if datatype == "BF16":
        return RNG.standard_normal(shape).astype(ml_dtypes.bfloat16)
    if datatype == "BOOL":
        return RNG.integers(0, 2, shape).astype(bool)
    dtype = np.dtype(grpcclient.triton_to_np_dtype(datatype))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return RNG.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return RNG.standard_normal(shape).astype(dtype)


IDENTITY_TYPES = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BF16", "BYTES",
]  # fmt: skip


def _identity_shapes(client: grpcclient.InferenceServerClient, model: str) -> list[list[int]]:
    """Shapes to send: every -1 filled in, and for a batching model batch 1 and batch 3."""
    batching = client.get_model_config(model).config.max_batch_size > 0
    dims = list(client.get_model_metadata(model).inputs[0].shape)
    fill = [2 if d == -1 else d for d in dims]
    if not batching:
        return [fill, [5 if d == -1 else d for d in dims]]
    return [[1, *fill[1:]], [3, *fill[1:]]]


@pytest.mark.parametrize("datatype", IDENTITY_TYPES)
def test_identity_round_trip(client: grpcclient.InferenceServerClient, datatype: str) -> None:
    model = f"identity_{datatype.lower()}"
    if not (EXAMPLES / model).is_dir():
        pytest.skip(f"examples/models/{model} is not in the repository")
    for shape in _identity_shapes(client, model):
        sent = _values(datatype, shape)
        result = client.infer(model, [tensor("INPUT0", sent, datatype)])
        output = result.get_output("OUTPUT0")
        assert (output.datatype, list(output.shape)) == (datatype, shape)
        got = result.as_numpy("OUTPUT0")
        if datatype == "BYTES":
            assert got.tolist() == sent.tolist()
        else:  # bit for bit: BF16 as its uint16 patterns, floats including signs of zero
            assert got.dtype == sent.dtype
            assert got.tobytes() == sent.tobytes()


def test_batch_limits(client: grpcclient.InferenceServerClient) -> None:
    """identity_fp32 batches (max_batch_size 8): the batch dimension is checked."""
    if not (EXAMPLES / "identity_fp32").is_dir():
        pytest.skip("examples/models/identity_fp32 is not in the repository")
    assert client.get_model_config("identity_fp32").config.max_batch_size == 8
    full = RNG.standard_normal((8, 5)).astype(np.float32)
    result = client.infer("identity_fp32", [tensor("INPUT0", full)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), full)
    too_big = np.zeros((9, 5), np.float32)
    message = raises_status(
        "INVALID_ARGUMENT", client.infer, "identity_fp32", [tensor("INPUT0", too_big)]
    )
    assert "batch-size must be <= 8" in message
    (stats,) = client.get_inference_statistics("identity_fp32").model_stats
    assert 8 in {b.batch_size for b in stats.batch_stats}


# -- bad requests: Triton's codes, and the server stays up -----------------------------
def _bad_requests() -> list[Any]:
    a = np.ones(4, np.float32)
    shape = tensor("INPUT0", a)
    shape.set_shape([3])  # 16 bytes sent for a [3] FP32 tensor
    return [
        pytest.param("no_such_model", [tensor("INPUT0", a), tensor("INPUT1", a)], "", "NOT_FOUND",
                     "Request for unknown model: 'no_such_model' is not found", id="model"),
        pytest.param("add_sub", [tensor("INPUT0", a), tensor("INPUT1", a)], "99", "NOT_FOUND",
                     "Request for unknown model: 'add_sub' version 99 is not found", id="version"),
        pytest.param("add_sub", [tensor("INPUT0", a), tensor("X", a)], "",
                     "INVALID_ARGUMENT", "unexpected inference input 'X' for model 'add_sub'",
                     id="unknown-input"),
        pytest.param("add_sub", [tensor("INPUT0", a), tensor("INPUT1", a), tensor("X", a)], "",
                     "INVALID_ARGUMENT", "expected 2 inputs but got 3 inputs for model 'add_sub'",
                     id="too-many"),
        pytest.param("add_sub", [tensor("INPUT0", a)], "", "INVALID_ARGUMENT",
                     "expected 2 inputs but got 1 inputs for model 'add_sub'", id="missing"),
        pytest.param("add_sub", [tensor("INPUT0", a), tensor("INPUT1", a.astype(np.int32))], "",
                     "INVALID_ARGUMENT",
                     "inference input 'INPUT1' data-type is 'INT32', but model 'add_sub' "
                     "expects 'FP32'", id="dtype"),
        pytest.param("add_sub", [tensor("INPUT0", a.reshape(2, 2)), tensor("INPUT1", a)], "",
                     "INVALID_ARGUMENT",
                     "unexpected shape for input 'INPUT0' for model 'add_sub'. Expected [-1], "
                     "got [2,2]", id="shape"),
        pytest.param("add_sub", [shape, tensor("INPUT1", a[:3])], "", "INVALID_ARGUMENT",
                     "input byte size mismatch for input 'INPUT0' for model 'add_sub'. "
                     "Expected 12, got 16", id="byte-size"),
    ]  # fmt: skip


@pytest.mark.parametrize(("model", "inputs", "version", "status", "message"), _bad_requests())
def test_bad_request(
    client: grpcclient.InferenceServerClient, example_server: RunningServer, model: str,
    inputs: list[grpcclient.InferInput], version: str, status: str, message: str,
) -> None:  # fmt: skip
    got = raises_status(status, client.infer, model, inputs, model_version=version)
    assert message in got
    assert example_server.alive()
    check_add_sub(client)


def test_unknown_requested_output(client: grpcclient.InferenceServerClient) -> None:
    inputs, _, _ = add_sub_inputs()
    outputs = [grpcclient.InferRequestedOutput("NOPE")]
    message = raises_status("INVALID_ARGUMENT", client.infer, "add_sub", inputs, outputs=outputs)
    assert "unexpected inference output 'NOPE' for model 'add_sub'" in message


def test_malformed_infer_message(
    client: grpcclient.InferenceServerClient, example_server: RunningServer
) -> None:
    """Bytes that are no ModelInferRequest, sent on a well-formed gRPC call."""
    with grpc.insecure_channel(example_server.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\x3a\xff\xff\x03garbage", timeout=DEADLINE_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed ModelInferRequest" in info.value.details()
    check_add_sub(client)


@pytest.mark.parametrize(
    "garbage",
    [
        bytes(range(256)) * 64,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 4096,  # preface, then a broken frame
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"
        + b"\x00\x7f\xff\x01\x05\x00\x00\x00\x01"
        + b"\x00" * 64,  # headers frame of junk
    ],
)
def test_garbage_on_the_grpc_port(
    client: grpcclient.InferenceServerClient, example_server: RunningServer, garbage: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", example_server.grpc_port), DEADLINE_S) as sock:
        try:
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):  # until the server closes the connection
                pass
        except OSError:
            pass  # the server may reset or close first: then it is not connected any more
    assert example_server.alive()
    assert client.is_server_live()
    check_add_sub(client)


# -- statistics and repository ---------------------------------------------------------
def _add_sub_stats(client: grpcclient.InferenceServerClient) -> Any:
    (stats,) = client.get_inference_statistics("add_sub").model_stats
    return stats


def test_statistics_count_inferences(client: grpcclient.InferenceServerClient) -> None:
    before = _add_sub_stats(client)
    for _ in range(3):
        check_add_sub(client)
    bad = [tensor("INPUT0", np.ones(2, np.float32)), tensor("INPUT1", np.ones(2, np.int32))]
    raises_status("INVALID_ARGUMENT", client.infer, "add_sub", bad)
    after = _add_sub_stats(client)
    assert (after.name, after.version) == ("add_sub", "1")
    assert after.inference_count - before.inference_count == 3
    assert after.execution_count - before.execution_count == 3
    infer = after.inference_stats
    assert infer.success.count - before.inference_stats.success.count == 3
    assert infer.fail.count - before.inference_stats.fail.count == 1
    assert infer.success.ns > before.inference_stats.success.ns
    assert infer.compute_infer.count - before.inference_stats.compute_infer.count == 3
    assert after.last_inference >= before.last_inference > 0
    assert sum(b.compute_infer.count for b in after.batch_stats) == after.execution_count


def test_statistics_of_every_model_and_unknown_model(
    client: grpcclient.InferenceServerClient,
) -> None:
    names = {s.name for s in client.get_inference_statistics().model_stats}
    assert "add_sub" in names
    message = raises_status("INVALID_ARGUMENT", client.get_inference_statistics, "no_such_model")
    assert message == "requested model 'no_such_model' is not available"
    message = raises_status("INVALID_ARGUMENT", client.get_inference_statistics, "add_sub", "7")
    assert message == "requested model version is not available for model 'add_sub'"


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("-1", "invalid model version specified '-1' , version should be an integral value > 0"),
        ("abc", "failed to get model version from specified version string 'abc' (details: "
                "stol), version should be an integral value > 0"),
        ("99999999999999999999", "failed to get model version from specified version string "
                                 "'99999999999999999999' (details: stol), version should be an "
                                 "integral value > 0"),
    ],
)  # fmt: skip
def test_bad_versions_are_refused_as_triton_refuses_them(
    client: grpcclient.InferenceServerClient, version: str, message: str
) -> None:
    calls = (client.is_model_ready, client.get_model_metadata, client.get_model_config,
             client.get_inference_statistics)  # fmt: skip
    for call in calls:
        assert raises_status("INVALID_ARGUMENT", call, "add_sub", version) == message
    inputs, _, _ = add_sub_inputs()
    got = raises_status("INVALID_ARGUMENT", client.infer, "add_sub", inputs, model_version=version)
    assert got == message


def test_repository_index(client: grpcclient.InferenceServerClient) -> None:
    index = {(m.name, m.version): m for m in client.get_model_repository_index().models}
    entry = index[("add_sub", "1")]
    assert (entry.state, entry.reason) == ("READY", "")


def test_load_needs_explicit_mode(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="not allowed"):
        client.load_model("add_sub")
    with pytest.raises(InferenceServerException, match="not allowed"):
        client.unload_model("add_sub")
    assert client.is_model_ready("add_sub")


def test_unload_and_load(explicit_client: grpcclient.InferenceServerClient) -> None:
    assert explicit_client.is_model_ready("add_sub")
    explicit_client.unload_model("add_sub")
    assert not explicit_client.is_model_ready("add_sub")
    states = {m.name: m.state for m in explicit_client.get_model_repository_index().models}
    assert states["add_sub"] != "READY"
    raises_status("UNAVAILABLE", explicit_client.infer, "add_sub", add_sub_inputs()[0])
    explicit_client.load_model("add_sub")
    assert explicit_client.is_model_ready("add_sub")
    check_add_sub(explicit_client)


def test_load_with_config_override(explicit_client: grpcclient.InferenceServerClient) -> None:
    current = explicit_client.get_model_config("add_sub").config
    config = json.loads(json_format.MessageToJson(current, preserving_proto_field_name=True))
    config["instance_group"] = [{"count": 2, "kind": "KIND_CPU"}]
    explicit_client.load_model("add_sub", config=json.dumps(config))
    assert explicit_client.get_model_config("add_sub").config.instance_group[0].count == 2
    check_add_sub(explicit_client)


SENT_MODEL = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        folder = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(folder, "factor.txt")) as f:
            self.factor = float(f.read())
        self.folder = args["model_repository"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            folder = np.array([self.folder.encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", (x * self.factor).astype(np.float32)),
                pb_utils.Tensor("FOLDER", folder),
            ]))
        return responses
"""


def sent_config(name: str) -> str:
    return json.dumps({
        "name": name, "backend": "python", "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]},
                   {"name": "FOLDER", "data_type": "TYPE_STRING", "dims": [1]}],
    })  # fmt: skip


def sent_files(factor: int) -> dict[str, bytes]:
    return {"file:1/model.py": SENT_MODEL.encode(), "file:1/factor.txt": str(factor).encode()}


def infer_sent(client: grpcclient.InferenceServerClient, name: str) -> tuple[Any, Path]:
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
    result = client.infer(name, [tensor])
    return result.as_numpy("OUTPUT0").tolist(), Path(result.as_numpy("FOLDER")[0].decode())


def test_load_a_model_from_files_sent_with_the_request(
    explicit_client: grpcclient.InferenceServerClient,
) -> None:
    """tritonclient's load_model(config=..., files=...): the files form the model's folder
    (a model the repository does not have); loaded again with other files, it serves those
    and the old folder is gone; unloaded, nothing is left."""
    explicit_client.load_model("sent", config=sent_config("sent"), files=sent_files(3))
    output, folder = infer_sent(explicit_client, "sent")
    assert output == [3.0, 6.0] and (folder / "1" / "factor.txt").read_text() == "3"
    explicit_client.load_model("sent", config=sent_config("sent"), files=sent_files(5))
    output, second = infer_sent(explicit_client, "sent")
    assert output == [5.0, 10.0] and second != folder and not folder.exists()
    explicit_client.unload_model("sent")
    assert not second.exists()


def test_sent_files_stand_in_for_a_repository_model_until_it_is_loaded_again(
    explicit_client: grpcclient.InferenceServerClient,
) -> None:
    explicit_client.load_model("add_sub", config=sent_config("add_sub"), files=sent_files(2))
    output, folder = infer_sent(explicit_client, "add_sub")
    assert output == [2.0, 4.0]
    explicit_client.load_model("add_sub")  # from the repository again, which was not touched
    check_add_sub(explicit_client)
    assert not folder.exists()


def test_load_rejects_bad_files_and_parameters(
    explicit_client: grpcclient.InferenceServerClient, explicit_server: RunningServer
) -> None:
    message = raises_status("INVALID_ARGUMENT", explicit_client.load_model, "sent",
                            files=sent_files(3))  # fmt: skip
    assert "a load request that sends the model's files must also send its 'config'" in message
    for bad in ("file:../model.py", "file:/etc/model.py", "file:"):
        message = raises_status("INVALID_ARGUMENT", explicit_client.load_model, "sent",
                                config=sent_config("sent"), files={bad: b"x"})  # fmt: skip
        assert f"invalid model file '{bad}'" in message
    request = service_pb2.RepositoryModelLoadRequest(model_name="add_sub")
    request.parameters["config"].bool_param = True
    with grpc.insecure_channel(explicit_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.RepositoryModelLoad(request, timeout=DEADLINE_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert explicit_client.is_model_ready("add_sub")


# -- trace and log settings ------------------------------------------------------------
def test_trace_settings(explicit_client: grpcclient.InferenceServerClient) -> None:
    settings = explicit_client.get_trace_settings().settings
    assert list(settings["trace_level"].value) == ["OFF"]
    updated = explicit_client.update_trace_settings(
        settings={"trace_rate": "7", "trace_level": ["TIMESTAMPS"]}
    ).settings
    assert (list(updated["trace_rate"].value), list(updated["trace_level"].value)) == (
        ["7"],
        ["TIMESTAMPS"],
    )
    model = explicit_client.update_trace_settings("add_sub", {"trace_count": "3"}).settings
    assert (list(model["trace_count"].value), list(model["trace_rate"].value)) == (["3"], ["7"])
    assert list(explicit_client.get_trace_settings().settings["trace_count"].value) == ["-1"]
    cleared = explicit_client.update_trace_settings(settings={"trace_rate": None}).settings
    assert list(cleared["trace_rate"].value) == ["1000"]


def test_trace_settings_rejected(explicit_client: grpcclient.InferenceServerClient) -> None:
    raises_status("INVALID_ARGUMENT", explicit_client.get_trace_settings, "no_such_model")
    raises_status("UNIMPLEMENTED", explicit_client.update_trace_settings,
                  settings={"trace_file": "/tmp/t"})  # fmt: skip
    raises_status("INVALID_ARGUMENT", explicit_client.update_trace_settings,
                  settings={"trace_rate": "often"})  # fmt: skip


def test_log_settings(explicit_client: grpcclient.InferenceServerClient) -> None:
    settings = explicit_client.get_log_settings().settings
    assert settings["log_verbose_level"].uint32_param == 0
    assert settings["log_info"].bool_param is True
    try:
        updated = explicit_client.update_log_settings(
            {"log_verbose_level": 2, "log_format": "ISO8601", "log_info": False}
        ).settings
        assert updated["log_verbose_level"].uint32_param == 2
        assert updated["log_format"].string_param == "ISO8601"
        assert updated["log_info"].bool_param is False
        got = explicit_client.get_log_settings().settings
        assert got["log_verbose_level"].uint32_param == 2
    finally:
        explicit_client.update_log_settings(
            {"log_verbose_level": 0, "log_format": "default", "log_info": True}
        )


def test_log_settings_rejected(explicit_client: grpcclient.InferenceServerClient) -> None:
    raises_status("UNIMPLEMENTED", explicit_client.update_log_settings, {"log_file": "/tmp/l"})
    raises_status("INVALID_ARGUMENT", explicit_client.update_log_settings, {"log_format": "x"})
    raises_status("INVALID_ARGUMENT", explicit_client.update_log_settings, {"log_info": None})
    assert explicit_client.get_log_settings().settings["log_format"].string_param == "default"


def test_unknown_log_settings_are_ignored(
    explicit_client: grpcclient.InferenceServerClient,
) -> None:
    """As Triton reads only the settings it knows (the answer shows what applies)."""
    before = explicit_client.get_log_settings(as_json=True)
    after = explicit_client.update_log_settings({"log_nope": True}, as_json=True)
    assert after == before and "log_nope" not in after["settings"]
