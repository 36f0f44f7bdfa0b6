"""ModelStreamInfer with Triton's ``triton_grpc_error`` header, driven by tritonclient's
``start_stream(headers=...)``: an error of inference (the model raised, or answered with an
error) ends the stream with the error's gRPC status, and the stream's other requests are
cancelled; a request refused before it runs is still answered in the stream, as Triton
answers it. Without the header every error is a message and the stream goes on.
"""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, RunningServer, run_server

DEADLINE_S = 60.0
GRPC_ERROR = {"triton_grpc_error": "true"}
RAISED = "raises: execute failed on purpose"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("stream_errors")
    for name in ("double", "raises", "returns_error", "repeat"):
        shutil.copytree(TEST_MODELS / name, repository / name)
    with run_server(repository) as running:
        yield running


class Stream:
    """One ModelStreamInfer call; what arrives (results and errors) in order."""

    def __init__(self, server: RunningServer, headers: dict[str, str] | None) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.arrived: queue.Queue[Any] = queue.Queue()
        self.client.start_stream(callback=self._arrive, headers=headers)

    def _arrive(self, result: Any, error: Any) -> None:
        self.arrived.put(error if error is not None else result)

    def next(self) -> Any:
        return self.arrived.get(timeout=DEADLINE_S)

    def double(self, value: float, request_id: str = "") -> None:
        self.client.async_stream_infer("double", [fp32("INPUT0", value)], request_id=request_id)

    def send(self, model: str, name: str, array: Any, **parameters: Any) -> None:
        tensor = grpcclient.InferInput(name, list(array.shape), "INT32" if array.dtype.kind == "i"
                                       else "FP32")  # fmt: skip
        tensor.set_data_from_numpy(array)
        self.client.async_stream_infer(model, [tensor], parameters=parameters or None)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def fp32(name: str, value: float) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "FP32")
    tensor.set_data_from_numpy(np.array([value], np.float32))
    return tensor


def int32(value: int) -> Any:
    return np.array([value], np.int32)


@pytest.fixture
def strict(server: RunningServer) -> Iterator[Stream]:
    stream = Stream(server, GRPC_ERROR)
    yield stream
    stream.close()


def doubled(result: Any) -> float:
    assert not isinstance(result, Exception), result
    return float(result.as_numpy("OUTPUT0")[0])


def test_a_model_that_raises_ends_the_stream_with_its_status(strict: Stream) -> None:
    strict.double(1.5)
    assert doubled(strict.next()) == 3.0
    strict.send("raises", "INPUT0", np.array([1.0], np.float32))
    error = strict.next()
    assert isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.INTERNAL" and RAISED in error.message()
    with pytest.raises(InferenceServerException, match="no longer in valid state"):
        strict.double(2.0)  # tritonclient: the stream has ended


@pytest.mark.parametrize(
    ("code", "status"),
    [(2, "NOT_FOUND"), (3, "INVALID_ARGUMENT"), (4, "UNAVAILABLE"), (5, "UNIMPLEMENTED")],
)
def test_an_error_response_ends_the_stream_with_its_code(
    strict: Stream, code: int, status: str
) -> None:
    strict.send("returns_error", "CODE", int32(code))
    error = strict.next()
    assert isinstance(error, InferenceServerException)
    assert error.status() == f"StatusCode.{status}"
    assert error.message() == f"returns_error: code {code} on purpose"


def test_a_decoupled_models_error_response_ends_the_stream(strict: Stream) -> None:
    """The responses before the error arrive; the stream ends with the error; nothing of the
    request arrives after it (tritonclient stops reading at the status)."""
    strict.send("repeat", "COUNT", int32(5), fail_at=2)
    assert [int(strict.next().as_numpy("INDEX")[0]) for _ in range(2)] == [0, 1]
    error = strict.next()
    assert isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.INTERNAL"
    assert error.message() == "repeat: response 2 failed on purpose"
    assert strict.arrived.empty()


def test_the_streams_other_requests_are_cancelled(server: RunningServer, strict: Stream) -> None:
    strict.send("repeat", "COUNT", int32(1), until_cancelled=True)
    assert int(strict.next().as_numpy("INDEX")[0]) == 0  # it runs, and sends until cancelled
    strict.send("raises", "INPUT0", np.array([1.0], np.float32))
    while not isinstance(last := strict.next(), InferenceServerException):
        pass  # the running request's responses, until the status
    assert last.status() == "StatusCode.INTERNAL" and RAISED in last.message()
    other = Stream(server, None)
    try:  # the model answers "report" once it has seen a cancellation: how many it saw
        other.send("repeat", "COUNT", int32(1), report=True)
        assert int(other.next().as_numpy("INDEX")[0]) == 1
    finally:
        other.close()


def test_a_refused_request_is_answered_in_the_stream(strict: Stream) -> None:
    """As Triton answers a request it cannot issue: an error message, the stream goes on."""
    strict.client.async_stream_infer("no_such_model", [fp32("INPUT0", 1.0)], request_id="lost")
    refused = strict.next()
    assert isinstance(refused, InferenceServerException) and refused.status() is None
    assert "no_such_model" in refused.message()
    strict.client.async_stream_infer("double", [fp32("INPUT0", 1.0), fp32("EXTRA", 1.0)])
    refused = strict.next()
    assert refused.status() is None and "expected 1 inputs but got 2 inputs" in refused.message()
    strict.double(4.0)
    assert doubled(strict.next()) == 8.0


@pytest.mark.parametrize("headers", [None, {"triton_grpc_error": "false"}])
def test_without_the_header_errors_are_messages(
    server: RunningServer, headers: dict[str, str] | None
) -> None:
    stream = Stream(server, headers)
    try:
        stream.send("raises", "INPUT0", np.array([1.0], np.float32))
        error = stream.next()
        assert isinstance(error, InferenceServerException)
        assert error.status() is None and RAISED in error.message()
        stream.send("repeat", "COUNT", int32(3), fail_at=1)
        first, failed, last = (stream.next() for _ in range(3))
        assert int(first.as_numpy("INDEX")[0]) == 0 and int(last.as_numpy("INDEX")[0]) == 2
        assert (
            failed.status() is None and failed.message() == "repeat: response 1 failed on purpose"
        )
        stream.double(1.0)
        assert doubled(stream.next()) == 2.0
    finally:
        stream.close()
