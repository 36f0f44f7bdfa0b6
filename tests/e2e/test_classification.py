"""Triton's classification extension: outputs requested with ``class_count`` come back as
their top-k "value:index[:label]" entries (tests/models/classifier; labels.txt has no
label for index 2)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import RunningServer

BATCH = np.array([[0.1, 0.9, 0.5, 0.9, 0.2], [5, 4, 3, 2, 1]], dtype=np.float32)


@pytest.fixture(scope="module", params=["grpc", "http"])
def client(request: pytest.FixtureRequest, test_server: RunningServer) -> Iterator[Any]:
    if request.param == "grpc":
        with grpcclient.InferenceServerClient(test_server.grpc_url) as c:
            yield c
    else:
        c = httpclient.InferenceServerClient(test_server.http_url)
        yield c
        c.close()


def infer(client: Any, outputs: dict[str, int], data: Any = BATCH) -> Any:
    lib = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    tensor = lib.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    requested = [lib.InferRequestedOutput(name, class_count=k) for name, k in outputs.items()]
    return client.infer("classifier", [tensor], outputs=requested)


def test_top_k_per_batch_entry_with_labels(client: Any) -> None:
    result = infer(client, {"OUTPUT0": 3, "OUTPUT1": 2})
    assert result.as_numpy("OUTPUT0").tolist() == [
        [b"0.900000:1:dog", b"0.900000:3:bird", b"0.500000:2"],  # ties in index order
        [b"5.000000:0:cat", b"4.000000:1:dog", b"3.000000:2"],
    ]
    assert result.as_numpy("OUTPUT1").tolist() == [[b"9:1", b"9:3"], [b"50:0", b"40:1"]]


def test_more_classes_than_values_gives_them_all(client: Any) -> None:
    result = infer(client, {"OUTPUT1": 10}, BATCH[1:])
    assert result.as_numpy("OUTPUT1").shape == (1, 5)
    assert result.as_numpy("OUTPUT1")[0, -1] == b"10:4"


def test_class_count_zero_is_the_output_itself(client: Any) -> None:
    result = infer(client, {"OUTPUT0": 0})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), BATCH)


def test_an_unsupported_type_is_refused(client: Any) -> None:
    with pytest.raises(InferenceServerException) as raised:
        infer(client, {"OUTPUT2": 2})
    assert "class result not available for output due to unsupported type 'FP16'" in str(
        raised.value.message()
    )


def test_a_decoupled_models_responses_are_classified(test_server: RunningServer) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(test_server.grpc_url) as c:
        c.start_stream(lambda result, error: responses.put(error or result))
        count = grpcclient.InferInput("COUNT", [1], "INT32")
        count.set_data_from_numpy(np.array([2], dtype=np.int32))
        index = grpcclient.InferRequestedOutput("INDEX", class_count=1)
        c.async_stream_infer("repeat", [count], outputs=[index])
        got = [responses.get(timeout=30).as_numpy("INDEX").tolist() for _ in range(2)]
        c.stop_stream()
    assert got == [[b"0:0"], [b"1:0"]]


def test_classification_into_shared_memory_is_refused(test_server: RunningServer) -> None:
    """tritonclient refuses to send it; a client that does gets Triton's message (raw
    protobuf: the region need not exist, the check comes first)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="classifier")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 5])
    tensor.contents.fp32_contents.extend(BATCH[0].tolist())
    output = request.outputs.add(name="OUTPUT0")
    output.parameters["classification"].int64_param = 2
    output.parameters["shared_memory_region"].string_param = "anywhere"
    output.parameters["shared_memory_byte_size"].int64_param = 64
    with (
        grpc.insecure_channel(test_server.grpc_url) as channel,
        pytest.raises(grpc.RpcError) as raised,
    ):
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Output can't set both 'shared_memory_region' and 'classification'" in str(
        raised.value.details()
    )
