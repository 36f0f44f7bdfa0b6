"""``async def execute`` of decoupled models (Triton 24.04 and later), through a real server
and real workers, driven by tritonclient over gRPC and by HTTP's generate extension.

- an instance runs its requests' coroutines side by side on its event loop: eight requests
  that each await one second on one instance are all answered in about one second, not
  eight, over a gRPC stream, HTTP ``generate`` and ``generate_stream``, and with BLS
  ``async_exec`` inside (after the wait, or of a callee that itself waits);
- an exception raised in one of them reaches its client, with its message, and the others
  are answered;
- tasks a coroutine starts keep running after it returned (the loop lives on) and send
  their responses;
- a decoupled model whose execute returns responses gets Triton's message.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import queue
import shutil
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import TEST_MODELS, RunningServer, run_server

MODEL = "async_waiter"
CALLEE = "async_waiter_callee"
CONCURRENT = 8
WAIT_S = 1.0
# Eight waits of one second take eight seconds one after another: well under that, they
# overlapped (the bound leaves room for a slow, shared machine).
BOUND_S = 4.0
TIMEOUT_S = 60
Results = queue.Queue[tuple[Any, Any]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("async_repo")
    shutil.copytree(TEST_MODELS / MODEL, repository / MODEL)
    shutil.copytree(TEST_MODELS / MODEL, repository / CALLEE)
    for name in ("decoupled_returns", "default_sender"):
        shutil.copytree(TEST_MODELS / name, repository / name)
    with run_server(repository) as running:
        yield running


def value(n: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([n], np.int32))
    return [tensor]


def stream_all(
    server: RunningServer, requests: list[dict[str, Any]], model: str = MODEL
) -> tuple[list[tuple[Any, Any]], float]:
    """Send ``requests`` (parameters, each with its IN) on one gRPC stream; every response
    and error until each request has its final one, and the seconds that took."""
    results: Results = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        started = time.monotonic()
        for index, params in enumerate(requests):
            client.async_stream_infer(
                model, value(index), request_id=str(index), parameters=params,
                enable_empty_final_response=True,
            )  # fmt: skip
        received = []
        finals = 0
        while finals < len(requests):
            result, error = results.get(timeout=TIMEOUT_S)
            received.append((result, error))
            finals += error is not None or final(result)
        elapsed = time.monotonic() - started
        client.stop_stream()
    return received, elapsed


def final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def answers(received: list[tuple[Any, Any]]) -> dict[str, int]:
    """Each request's OUT, by request id (responses with outputs only)."""
    found = {}
    for result, error in received:
        assert error is None, error
        if result.get_response().outputs:
            found[result.get_response().id] = int(result.as_numpy("OUT")[0])
    return found


def counts(server: RunningServer) -> tuple[int, int, int]:
    """The model's successes, inferences and executions, from its statistics."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        [stats] = client.get_inference_statistics(MODEL).model_stats
    return stats.inference_stats.success.count, stats.inference_count, stats.execution_count


def test_eight_waits_overlap_over_a_grpc_stream(server: RunningServer) -> None:
    before = counts(server)
    received, elapsed = stream_all(server, [{"wait_s": WAIT_S}] * CONCURRENT)
    assert answers(received) == {str(i): i for i in range(CONCURRENT)}
    assert WAIT_S <= elapsed < BOUND_S, elapsed
    after = counts(server)  # each request is one execute, counted as any other
    assert [a - b for a, b in zip(after, before, strict=True)] == [CONCURRENT] * 3


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_eight_waits_overlap_over_http(server: RunningServer, endpoint: str) -> None:
    def generate(n: int) -> Any:
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=TIMEOUT_S)
        try:
            body = json.dumps({"IN": [n], "wait_s": WAIT_S}).encode()
            connection.request("POST", f"/v2/models/{MODEL}/{endpoint}", body,
                               {"Content-Type": "application/json"})  # fmt: skip
            response = connection.getresponse()
            raw = response.read()
            assert response.status == 200, raw
        finally:
            connection.close()
        if endpoint == "generate":
            return json.loads(raw)["OUT"]
        events = [line[len(b"data: ") :] for line in raw.splitlines() if line.startswith(b"data: ")]
        return [json.loads(event)["OUT"] for event in events]

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        outputs = list(pool.map(generate, range(CONCURRENT)))
    elapsed = time.monotonic() - started
    expected = list(range(CONCURRENT))  # one value: a scalar; one event per request
    assert outputs == (expected if endpoint == "generate" else [[n] for n in expected])
    assert WAIT_S <= elapsed < BOUND_S, elapsed


@pytest.mark.parametrize(
    ("params", "times", "plus"),
    [  # the callees: default_sender answers IN * 10 + 3 at once, async_waiter IN after a wait
        pytest.param({"wait_s": WAIT_S, "callee": "default_sender"}, 10, 3,
                     id="wait-then-async_exec"),
        pytest.param({"callee": CALLEE, "callee_wait_s": WAIT_S, "callee_decoupled": True}, 1,
                     0, id="async_exec-of-a-waiting-decoupled-callee"),
    ],
)  # fmt: skip
def test_eight_waits_overlap_with_bls_async_exec(
    server: RunningServer, params: dict[str, Any], times: int, plus: int
) -> None:
    received, elapsed = stream_all(server, [params] * CONCURRENT)
    assert answers(received) == {str(i): i * times + plus for i in range(CONCURRENT)}
    assert WAIT_S <= elapsed < BOUND_S, elapsed


def test_an_exception_in_one_reaches_its_client_and_the_others_go_on(
    server: RunningServer,
) -> None:
    requests = [{"wait_s": WAIT_S / 4}, {"wait_s": WAIT_S / 8, "fail": True}, {}]
    received, _ = stream_all(server, requests)
    errors = [error for _, error in received if error is not None]
    assert len(errors) == 1
    assert "ValueError: async_waiter: request 1 failed on purpose" in errors[0].message()
    good = [(result, error) for result, error in received if error is None]
    assert answers(good) == {"0": 0, "2": 2}


def test_tasks_started_by_execute_run_after_it_returned(server: RunningServer) -> None:
    received, _ = stream_all(server, [{"later": 3}, {"later": 2}])
    outputs: dict[str, list[int]] = {"0": [], "1": []}
    for result, error in received:
        assert error is None, error
        if result.get_response().outputs:
            outputs[result.get_response().id].append(int(result.as_numpy("OUT")[0]))
    assert outputs == {"0": [0, 1, 2], "1": [1, 2]}


RETURNED = "is using the decoupled mode and the execute function must return None."


def test_decoupled_execute_that_returns_responses_gets_tritons_message(
    server: RunningServer,
) -> None:
    received, _ = stream_all(server, [{}], model="decoupled_returns")
    [(_, error)] = received
    assert f"Python model 'decoupled_returns_0_0' {RETURNED}" in error.message()


def test_async_decoupled_execute_that_returns_responses_gets_tritons_message(
    server: RunningServer,
) -> None:
    received, _ = stream_all(server, [{"returns": True}])
    [(_, error)] = received
    assert f"Python model '{MODEL}_0_0' {RETURNED}" in error.message()
