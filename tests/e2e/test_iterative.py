"""Iterative sequences (``sequence_batching { iterative_sequence: true }``): continuous
batching for models that work on a request over several executes, rescheduling it with
``request.set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``, as in Triton."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, RunningServer, repository_of, run_server, wait_pending

MODELS = ("iterative_steps", "iterative_countdown", "reschedule_refused", "plain")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = repository_of(tmp_path_factory.mktemp("repo"), *(TEST_MODELS / m for m in MODELS))
    with run_server(root) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        yield c


def steps_input(steps: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("STEPS", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[steps]], np.int32))
    return [tensor]


def executions(client: grpcclient.InferenceServerClient, model: str) -> tuple[int, int, int]:
    """(execution_count, successful requests, inference_count) of ``model``."""
    stats = client.get_inference_statistics(model).model_stats[0]
    return stats.execution_count, stats.inference_stats.success.count, stats.inference_count


def test_a_request_runs_until_the_model_stops_rescheduling_it(
    client: grpcclient.InferenceServerClient,
) -> None:
    before = executions(client, "iterative_steps")
    result = client.infer("iterative_steps", steps_input(3), request_id="alone")
    assert result.as_numpy("COUNT").tolist() == [[3]]
    assert result.as_numpy("WIDEST").tolist() == [[1]]
    after = executions(client, "iterative_steps")
    # 3 executes, 1 request, and (as Triton counts them) an inference per execute
    assert tuple(a - b for a, b in zip(after, before, strict=True)) == (3, 1, 3)


def two_at_once(url: str, *requests: dict[str, Any]) -> dict[str, Any]:
    """Send two iterative_steps requests from two threads, the first one first (each a dict
    of infer() arguments with a request_id); their results (or errors) by request id."""
    results: queue.Queue[tuple[str, Any]] = queue.Queue()

    def send(arguments: dict[str, Any]) -> None:
        with grpcclient.InferenceServerClient(url) as c:
            try:
                results.put((arguments["request_id"], c.infer("iterative_steps", **arguments)))
            except InferenceServerException as exc:
                results.put((arguments["request_id"], exc))

    threads = [threading.Thread(target=send, args=(arguments,)) for arguments in requests]
    with grpcclient.InferenceServerClient(url) as watcher:
        before = executions(watcher, "iterative_steps")[0]
        threads[0].start()
        deadline = time.monotonic() + 60  # the first runs (alone) before the second is sent
        while executions(watcher, "iterative_steps")[0] == before:
            assert time.monotonic() < deadline, "the first request did not start"
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(60)
    return dict(results.get_nowait() for _ in requests)


def test_new_requests_join_the_executes_of_requests_in_flight(server: RunningServer) -> None:
    """The first request counts an execute only when a second shares it: it finishes only
    if the scheduler batches the new request with the rescheduled one."""
    got = two_at_once(
        server.grpc_url,
        {"inputs": steps_input(2), "request_id": "first", "parameters": {"together": 2}},
        {"inputs": steps_input(4), "request_id": "second", "parameters": {"together": 1}},
    )
    outputs = {key: (r.as_numpy("COUNT").item(), r.as_numpy("WIDEST").item())
               for key, r in got.items()}  # fmt: skip
    assert outputs == {"first": (2, 2), "second": (4, 2)}


def data_input(value: float) -> grpcclient.InferInput:
    data = grpcclient.InferInput("DATA", [1, 100_000], "FP32")
    data.set_data_from_numpy(np.full((1, 100_000), value, np.float32))
    return data


def test_a_rescheduled_requests_inputs_stay_where_they_are_until_it_is_done(
    server: RunningServer,
) -> None:
    """``first`` (400 KB of DATA: in the input arena) waits, rescheduled, until ``second``
    shares its executes; the model kept the view of ``first``'s DATA from its first
    execute. Had that arena space gone back when ``first`` was rescheduled, ``second``'s
    DATA would have taken it."""
    got = two_at_once(
        server.grpc_url,
        {"inputs": [*steps_input(2), data_input(1.0)], "request_id": "first",
         "parameters": {"together": 2}},
        {"inputs": [*steps_input(2), data_input(2.0)], "request_id": "second",
         "parameters": {"together": 1}},
    )  # fmt: skip
    outputs = {key: (r.as_numpy("COUNT").item(), r.as_numpy("SAME").item())
               for key, r in got.items()}  # fmt: skip
    assert outputs == {"first": (2, True), "second": (2, True)}


def test_a_decoupled_model_streams_one_response_per_execute(
    client: grpcclient.InferenceServerClient,
) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([4], np.int32))
    client.async_stream_infer("iterative_countdown", [tensor], request_id="count",
                              enable_empty_final_response=True)  # fmt: skip
    values, final = [], False
    while not final:
        result, error = responses.get(timeout=60)
        assert error is None, error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        if result.as_numpy("OUT") is not None:
            values.append(result.as_numpy("OUT").item())
    client.stop_stream()
    assert values == [3, 2, 1, 0]
    stats = client.get_inference_statistics("iterative_countdown").model_stats[0]
    assert (stats.execution_count, stats.inference_count) == (4, 4)


def test_a_request_whose_client_leaves_is_not_run_again(
    server: RunningServer, client: grpcclient.InferenceServerClient
) -> None:
    """STEPS < 0: the model would reschedule it forever; the client's deadline ends it."""
    with pytest.raises(InferenceServerException, match="Deadline Exceeded"):
        client.infer("iterative_steps", steps_input(-1), request_id="forever", client_timeout=0.5)
    wait_pending(server, "iterative_steps", 0)
    count = executions(client, "iterative_steps")[0]
    result = client.infer("iterative_steps", steps_input(1), request_id="after")
    assert result.as_numpy("COUNT").tolist() == [[1]]  # the instance is free for others
    assert executions(client, "iterative_steps")[0] == count + 1  # and nothing else ran


def test_a_request_whose_instance_dies_fails_and_the_restarted_instance_serves(
    client: grpcclient.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException, match="is not healthy"):
        client.infer("iterative_steps", steps_input(5), request_id="crash",
                     parameters={"exit_at": 2})  # fmt: skip
    deadline = time.monotonic() + 60  # the pool restarts it: readiness says when
    while not client.is_model_ready("iterative_steps"):
        assert time.monotonic() < deadline, "the instance was not restarted"
    result = client.infer("iterative_steps", steps_input(2), request_id="later")
    assert result.as_numpy("COUNT").tolist() == [[2]]


def test_rescheduling_needs_an_iterative_model(client: grpcclient.InferenceServerClient) -> None:
    tensor = grpcclient.InferInput("STEPS", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("reschedule_refused", [tensor])
    message = str(caught.value)
    assert "request rescheduling needs a model whose config has sequence_batching" in message


def test_control_inputs_with_iterative_sequences_are_refused(tmp_path: Path) -> None:
    root = repository_of(tmp_path, TEST_MODELS / "iterative_steps")
    config = root / "iterative_steps" / "config.pbtxt"
    config.write_text(config.read_text().replace(
        "sequence_batching { iterative_sequence: true }",
        "sequence_batching { iterative_sequence: true control_input [ { name: \"S\" control [ "
        "{ kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] } ] } ] }",
    ))  # fmt: skip
    serving = run_server(root, "--exit-on-error", "false")  # the refusal is asked for
    with serving as s, grpcclient.InferenceServerClient(s.grpc_url) as c:
        index = {m.name: m for m in c.get_model_repository_index().models}
    assert index["iterative_steps"].state == "UNAVAILABLE"
    assert "'iterative_sequence' with control inputs" in index["iterative_steps"].reason
