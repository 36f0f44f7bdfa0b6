"""Decoupled models through a real server, driven by unmodified tritonclient.

- a decoupled model streams N responses over ModelStreamInfer (start_stream /
  async_stream_infer), the request id echoed, the final flag as Triton sends it
  (``triton_final_response`` when the client asks for empty final responses);
- an error response travels in the stream's ``error_message`` and the stream goes on;
- responses sent from a thread of the model after execute returned;
- a client that cancels its stream: the model sees ``is_cancelled()``;
- ModelInfer over gRPC and HTTP infer refuse a decoupled model with Triton's messages;
- a model that is not decoupled answers once over the stream;
- decoupled requests go through the model's scheduler: one execute at a time per
  instance, the others wait in the server's queue, whose limit refuses one more; the
  requests the dynamic batcher gathers come to one execute;
- a worker that dies in the middle of a stream ends it with an error; the instance comes
  back and serves the next request.
"""

from __future__ import annotations

import os
import queue
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, RunningServer, run_server

DEADLINE_S = 60.0
Results = queue.Queue[tuple[Any, Any]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("decoupled_repo")
    for name in ("repeat", "double", "gated_stream", "batched_stream"):
        shutil.copytree(TEST_MODELS / name, repository / name)
    with run_server(repository) as running:
        yield running


@pytest.fixture
def stream(server: RunningServer) -> Iterator[tuple[grpcclient.InferenceServerClient, Results]]:
    results: Results = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            yield client, results
        finally:
            client.stop_stream(cancel_requests=True)


def count(n: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("COUNT", [1], "INT32")
    tensor.set_data_from_numpy(np.array([n], dtype=np.int32))
    return [tensor]


def final_flag(result: Any) -> bool | None:
    params = result.get_response().parameters
    return params["triton_final_response"].bool_param if "triton_final_response" in params else None


def test_streams_n_responses_then_an_empty_final_one(
    stream: tuple[grpcclient.InferenceServerClient, Results],
) -> None:
    client, results = stream
    client.async_stream_infer("repeat", count(5), request_id="r5", enable_empty_final_response=True)
    received = [results.get(timeout=DEADLINE_S) for _ in range(6)]
    assert all(error is None for _, error in received)
    indices = [int(result.as_numpy("INDEX")[0]) for result, _ in received[:5]]
    assert indices == [0, 1, 2, 3, 4]
    assert [final_flag(result) for result, _ in received] == [False] * 5 + [True]
    last = received[5][0].get_response()
    assert last.id == "r5" and not last.outputs and last.model_name == "repeat"
    assert all(result.get_response().id == "r5" for result, _ in received)


def test_without_empty_final_response_only_the_responses_come(
    stream: tuple[grpcclient.InferenceServerClient, Results],
) -> None:
    client, results = stream
    client.async_stream_infer("repeat", count(3), request_id="a")
    client.async_stream_infer("repeat", count(0), request_id="nothing")  # zero responses
    client.async_stream_infer("double", [double_input()], request_id="b")  # a sentinel
    received = [results.get(timeout=DEADLINE_S) for _ in range(4)]
    ids = sorted(result.get_response().id for result, _ in received)
    assert ids == ["a", "a", "a", "b"]
    assert all(final_flag(result) is None for result, _ in received)


def double_input() -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
    return tensor


def test_error_in_the_stream_does_not_end_it(
    stream: tuple[grpcclient.InferenceServerClient, Results],
) -> None:
    client, results = stream
    client.async_stream_infer("repeat", count(4), request_id="f", parameters={"fail_at": 1},
                              enable_empty_final_response=True)  # fmt: skip
    received = [results.get(timeout=DEADLINE_S) for _ in range(5)]
    errors = [error for _, error in received if error is not None]
    assert len(errors) == 1 and "repeat: response 1 failed on purpose" in errors[0].message()
    good = [result for result, error in received if error is None]
    assert [int(r.as_numpy("INDEX")[0]) for r in good[:3]] == [0, 2, 3]
    assert final_flag(good[3]) is True


def test_responses_from_a_thread_after_execute_returned(
    stream: tuple[grpcclient.InferenceServerClient, Results],
) -> None:
    client, results = stream
    client.async_stream_infer("repeat", count(3), request_id="t", parameters={"threaded": True},
                              enable_empty_final_response=True)  # fmt: skip
    received = [results.get(timeout=DEADLINE_S) for _ in range(4)]
    assert [error for _, error in received] == [None] * 4
    assert [int(r.as_numpy("INDEX")[0]) for r, _ in received[:3]] == [0, 1, 2]


def test_non_decoupled_model_answers_once_over_the_stream(
    stream: tuple[grpcclient.InferenceServerClient, Results],
) -> None:
    client, results = stream
    client.async_stream_infer("double", [double_input()], request_id="d",
                              enable_empty_final_response=True)  # fmt: skip
    result, error = results.get(timeout=DEADLINE_S)
    assert error is None and final_flag(result) is True
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [2.0, 4.0])


def test_cancelled_stream_cancels_its_requests(server: RunningServer) -> None:
    """until_cancelled sends until is_cancelled(); the report waits for that to happen."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        results: Results = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("repeat", count(1), parameters={"until_cancelled": True})
        result, error = results.get(timeout=DEADLINE_S)  # it is running
        assert error is None and int(result.as_numpy("INDEX")[0]) == 0
        client.stop_stream(cancel_requests=True)

        reports: Results = queue.Queue()
        client.start_stream(callback=lambda result, error: reports.put((result, error)))
        try:
            client.async_stream_infer("repeat", count(1), parameters={"report": True})
            report, error = reports.get(timeout=DEADLINE_S)
        finally:
            client.stop_stream()
    assert error is None
    assert int(report.as_numpy("INDEX")[0]) >= 1  # the model saw is_cancelled()


def test_model_infer_refuses_a_decoupled_model(server: RunningServer) -> None:
    with (
        grpcclient.InferenceServerClient(server.grpc_url) as client,
        pytest.raises(InferenceServerException) as raised,
    ):
        client.infer("repeat", count(1))
    assert raised.value.status() == "StatusCode.UNIMPLEMENTED"
    assert raised.value.message() == (
        "ModelInfer RPC doesn't support models with decoupled transaction policy"
    )


def test_http_infer_refuses_a_decoupled_model(server: RunningServer) -> None:
    tensor = httpclient.InferInput("COUNT", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    with (
        httpclient.InferenceServerClient(server.http_url) as client,
        pytest.raises(InferenceServerException) as raised,
    ):
        client.infer("repeat", [tensor])
    assert raised.value.status() == "501"
    assert raised.value.message() == (
        "HTTP end point doesn't support models with decoupled transaction policy"
    )


def test_decoupled_requests_wait_in_the_schedulers_queue(
    stream: tuple[grpcclient.InferenceServerClient, Results], tmp_path: Path
) -> None:
    """gated_stream has one instance and a queue of one: while the first request executes,
    the second waits in the server and a third is refused (UNAVAILABLE, Triton's message);
    the second runs once the first's execute has returned."""
    client, results = stream
    fifos = {}
    for request in "abc":
        fifos[request] = (tmp_path / f"{request}_started", tmp_path / f"{request}_go")
        for fifo in fifos[request]:
            os.mkfifo(fifo)
    for request in "abc":
        control = grpcclient.InferInput("CONTROL", [2], "BYTES")
        control.set_data_from_numpy(np.array([str(f).encode() for f in fifos[request]],
                                             dtype=object))  # fmt: skip
        client.async_stream_infer("gated_stream", [control], request_id=request)
    started_a, go_a = fifos["a"]
    with open(started_a) as fifo:
        assert fifo.readline() == "started\n"  # a executes; b waits in the queue
    result, error = results.get(timeout=DEADLINE_S)
    assert result is None and error is not None
    assert error.message() == "Exceeds maximum queue size"  # c: the queue holds one
    with open(go_a, "w") as fifo:
        fifo.write("go\n")
    started_b, go_b = fifos["b"]
    with open(started_b) as fifo:  # b runs once a's execute has returned
        assert fifo.readline() == "started\n"
    with open(go_b, "w") as fifo:
        fifo.write("go\n")
    received = [results.get(timeout=DEADLINE_S) for _ in range(2)]
    assert [error for _, error in received] == [None, None]
    answers = {r.get_response().id: int(r.as_numpy("OUTPUT0")[0]) for r, _ in received}
    assert answers == {"a": 0, "b": 1}


def test_the_batcher_gathers_decoupled_requests_into_one_execute(
    stream: tuple[grpcclient.InferenceServerClient, Results],
) -> None:
    """batched_stream's batcher sends its batch when 4 requests wait: the 4 come to one
    execute(), each gets its own response through its own sender, and the statistics
    count executions of 4."""
    client, results = stream
    for batch in ("abcd", "wxyz"):
        for request in batch:
            tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
            client.async_stream_infer("batched_stream", [tensor], request_id=request)
        received = [results.get(timeout=DEADLINE_S) for _ in range(4)]
        assert [error for _, error in received] == [None] * 4
        assert sorted(r.get_response().id for r, _ in received) == sorted(batch)
        assert [int(r.as_numpy("BATCH")[0, 0]) for r, _ in received] == [4] * 4
    # counted as Triton counts them: 8 inferences in executions of 4 (the second
    # execution's count may still be on its way; the first's came before the second batch)
    stats = client.get_inference_statistics("batched_stream").model_stats[0]
    assert stats.inference_count == 8
    assert stats.execution_count in (1, 2)
    assert [b.batch_size for b in stats.batch_stats] == [4]


def test_a_worker_that_dies_mid_stream_ends_it_and_comes_back(
    stream: tuple[grpcclient.InferenceServerClient, Results],
) -> None:
    client, results = stream
    client.async_stream_infer("repeat", count(3), request_id="c", parameters={"crash_at": 1})
    first, error = results.get(timeout=DEADLINE_S)
    assert error is None and int(first.as_numpy("INDEX")[0]) == 0
    _, error = results.get(timeout=DEADLINE_S)
    assert error is not None
    # Triton's words for a stream whose instance died, and how its process ended
    assert error.message() == (
        "Stub process 'repeat_0_0' is not healthy. Its process exited with code 1."
    )
    deadline = time.monotonic() + DEADLINE_S
    while not client.is_model_ready("repeat"):  # a restart takes as long as it takes
        assert time.monotonic() < deadline, "repeat not ready again"
    client.async_stream_infer("repeat", count(2), request_id="after")  # its instance is free
    received = [results.get(timeout=DEADLINE_S) for _ in range(2)]
    assert [error for _, error in received] == [None, None]
    assert [int(r.as_numpy("INDEX")[0]) for r, _ in received] == [0, 1]
