"""The scheduler through a real server and tritonclient: dynamic batching, preferred
batch sizes, queue limits and timeouts, priorities, instances that take one execute at
a time, and cancellation of queued requests (gRPC cancel, HTTP connection closed).

The models (tests/models/batched and its variants) report which execute() call served a
request, how many requests it got and the request's place in it. A "gate" request holds
the only instance inside execute (FIFO handshake) while the test queues others; the
test sees them queued through Triton's ``nv_inference_pending_request_count`` gauge.
"""

from __future__ import annotations

import json
import queue
import re
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import (
    TEST_MODELS,
    FifoGate,
    RunningServer,
    repository_of,
    run_server,
    wait_pending,
)

DEADLINE_S = 60.0
MODELS = ("batched", "batched_preferred", "batched_limits", "serial")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    models = (TEST_MODELS / name for name in MODELS)
    with run_server(repository_of(tmp_path_factory.mktemp("scheduling_repo"), *models)) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as connected:
        yield connected


def _inputs(model: str, value: float, batch: int) -> list[Any]:
    shape = [batch, 1] if model != "serial" else [1]
    tensor = grpcclient.InferInput("INPUT0", shape, "FP32")
    tensor.set_data_from_numpy(np.full(shape, value, np.float32))
    return [tensor]


class Pending:
    """One asynchronous gRPC request and its outcome."""

    def __init__(
        self, client: Any, model: str, value: float = 1.0, batch: int = 1, **kwargs: Any
    ) -> None:
        self.model, self.value = model, value
        self._results: queue.Queue[Any] = queue.Queue()
        self.call = client.async_infer(model, _inputs(model, value, batch), self._done, **kwargs)

    def _done(self, result: Any, error: Any) -> None:
        self._results.put(error if error is not None else result)

    def outcome(self) -> Any:
        return self._results.get(timeout=DEADLINE_S)

    def result(self) -> dict[str, int]:
        """What the model reported; checks OUTPUT0."""
        outcome = self.outcome()
        if isinstance(outcome, Exception):
            raise outcome
        np.testing.assert_array_equal(outcome.as_numpy("OUTPUT0"), self.value * 2)
        return {k: int(outcome.as_numpy(k).flat[0]) for k in ("BATCH", "EXECUTION", "POSITION")}

    def error(self) -> InferenceServerException:
        outcome = self.outcome()
        assert isinstance(outcome, InferenceServerException), outcome
        return outcome


class Gate:
    """A request that holds the model's only instance inside execute until released."""

    def __init__(self, client: Any, model: str, folder: Path, batch: int = 1) -> None:
        self.fifos = FifoGate(folder)
        self.request = Pending(client, model, 0.5, batch, parameters=self.fifos.parameters)
        self.fifos.wait_started(DEADLINE_S)

    def release(self) -> dict[str, int]:
        self.fifos.open()
        return self.request.result()


def stats(client: Any, model: str) -> dict[str, Any]:
    found: dict[str, Any] = client.get_inference_statistics(model, as_json=True)
    return found["model_stats"][0]


def counts(client: Any, model: str) -> tuple[int, int, dict[int, int]]:
    """inference_count, execution_count, and executions per batch size."""
    s = stats(client, model)
    batches = {
        int(b["batch_size"]): int(b["compute_infer"].get("count", 0))
        for b in s.get("batch_stats", [])
    }
    return int(s.get("inference_count", 0)), int(s.get("execution_count", 0)), batches


def _delta(after: dict[int, int], before: dict[int, int]) -> dict[int, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


# -- dynamic batching ------------------------------------------------------------------------
def test_requests_that_wait_together_run_in_one_execute(
    client: Any, server: RunningServer, tmp_path: Path
) -> None:
    inferences, executions, batches = counts(client, "batched")
    gate = Gate(client, "batched", tmp_path)
    waiting = [Pending(client, "batched", float(i)) for i in range(1, 8)]  # 8 clients in all
    wait_pending(server, "batched", 7)
    first = gate.release()
    results = [p.result() for p in waiting]
    print("gate:", first, "others:", results)
    assert first["BATCH"] == 1
    assert {r["BATCH"] for r in results} == {7}  # the model saw len(requests) == 7
    assert {r["EXECUTION"] for r in results} == {first["EXECUTION"] + 1}
    assert sorted(r["POSITION"] for r in results) == list(range(7))
    after = counts(client, "batched")
    print("statistics after:", stats(client, "batched"))
    assert (after[0] - inferences, after[1] - executions) == (8, 2)  # executions < inferences
    assert _delta(after[2], batches) == {1: 1, 7: 1}  # Triton's batch_stats, per batch size


def test_an_error_response_fails_its_request_alone(
    client: Any, server: RunningServer, tmp_path: Path
) -> None:
    gate = Gate(client, "batched", tmp_path)
    good = Pending(client, "batched", 1.0)
    bad = Pending(client, "batched", 2.0, parameters={"fail": True})
    wait_pending(server, "batched", 2)
    gate.release()
    assert good.result()["BATCH"] == 2
    error = bad.error()
    assert error.status() == "StatusCode.INTERNAL"
    assert error.message() == "request 1 failed on purpose"


def test_a_preferred_batch_size_goes_at_once(
    client: Any, server: RunningServer, tmp_path: Path
) -> None:
    _, _, batches = counts(client, "batched_preferred")
    gate = Gate(client, "batched_preferred", tmp_path, batch=8)  # >= the preferred size: no wait
    waiting = [Pending(client, "batched_preferred", float(i)) for i in range(4)]
    wait_pending(server, "batched_preferred", 4)
    gate.release()
    results = [p.result() for p in waiting]
    print("with a preferred batch size of 2:", results)
    assert [r["BATCH"] for r in results] == [2, 2, 2, 2]
    assert len({r["EXECUTION"] for r in results}) == 2
    assert _delta(counts(client, "batched_preferred")[2], batches) == {8: 1, 2: 2}


def test_a_lone_request_waits_the_queue_delay_for_company(client: Any) -> None:
    started = time.monotonic()
    alone = Pending(client, "batched_preferred").result()
    waited = time.monotonic() - started
    print(f"alone: {alone}, after {waited:.2f} s (max_queue_delay 3 s)")
    assert alone["BATCH"] == 1
    assert waited >= 2.9


# -- queue policies and priorities -----------------------------------------------------------
def test_a_full_queue_refuses_with_unavailable(
    client: Any, server: RunningServer, tmp_path: Path
) -> None:
    gate = Gate(client, "batched_limits", tmp_path, batch=8)
    queued = [Pending(client, "batched_limits", 1.0, 8) for _ in range(2)]  # max_queue_size 2
    wait_pending(server, "batched_limits", 2)
    refused = Pending(client, "batched_limits", 1.0, 8).error()
    print("gRPC:", refused.status(), refused.message())
    assert refused.status() == "StatusCode.UNAVAILABLE"
    assert "Exceeds maximum queue size" in refused.message()
    with httpclient.InferenceServerClient(server.http_url) as http:
        tensor = httpclient.InferInput("INPUT0", [8, 1], "FP32")
        tensor.set_data_from_numpy(np.ones((8, 1), np.float32))
        with pytest.raises(InferenceServerException) as info:
            http.infer("batched_limits", [tensor])
    print("HTTP:", info.value.status(), info.value.message())
    assert (info.value.status(), info.value.message()) == ("503", "Exceeds maximum queue size")
    other_level = Pending(client, "batched_limits", 1.0, 8, priority=1)  # its own queue
    wait_pending(server, "batched_limits", 3)
    gate.release()
    for request in (*queued, other_level):
        assert request.result()["BATCH"] == 1


def test_a_request_past_its_timeout_is_rejected(
    client: Any, server: RunningServer, tmp_path: Path
) -> None:
    inferences, _, _ = counts(client, "batched_limits")
    gate = Gate(client, "batched_limits", tmp_path, batch=8)
    expired = Pending(client, "batched_limits", 1.0, 8, timeout=100_000).error()  # 100 ms
    print("timed out:", expired.status(), expired.message())
    assert expired.status() == "StatusCode.UNAVAILABLE"
    assert expired.message() == "Request timeout expired"
    gate.release()
    assert counts(client, "batched_limits")[0] - inferences == 8  # the gate's alone


def test_higher_priority_runs_first(client: Any, server: RunningServer, tmp_path: Path) -> None:
    gate = Gate(client, "batched_limits", tmp_path, batch=8)
    low = Pending(client, "batched_limits", 1.0, 8)  # the default level, 2
    high = Pending(client, "batched_limits", 2.0, 8, priority=1)
    wait_pending(server, "batched_limits", 2)
    gate.release()
    order = high.result()["EXECUTION"], low.result()["EXECUTION"]
    print("executions (high, low):", order)
    assert order[0] < order[1]


def test_a_delayed_request_runs_after_the_others(
    client: Any, server: RunningServer, tmp_path: Path
) -> None:
    gate = Gate(client, "batched_limits", tmp_path, batch=8)
    late = Pending(client, "batched_limits", 1.0, 8, priority=1, timeout=1)  # DELAY at level 1
    on_time = Pending(client, "batched_limits", 2.0, 8, priority=1)
    wait_pending(server, "batched_limits", 2)
    gate.release()
    order = on_time.result()["EXECUTION"], late.result()["EXECUTION"]
    print("executions (on time, timed out):", order)
    assert order[0] < order[1]


# -- without dynamic batching ----------------------------------------------------------------
def test_without_batching_requests_wait_in_the_server_for_the_instance(
    client: Any, server: RunningServer, tmp_path: Path
) -> None:
    inferences, executions, _ = counts(client, "serial")
    gate = Gate(client, "serial", tmp_path)
    waiting = [Pending(client, "serial", float(i)) for i in range(3)]
    wait_pending(server, "serial", 3)  # queued in the server, not in the worker's socket
    first = gate.release()
    results = [p.result() for p in waiting]
    assert {r["BATCH"] for r in results} == {1}
    assert sorted(r["EXECUTION"] for r in results) == [first["EXECUTION"] + i for i in (1, 2, 3)]
    after = counts(client, "serial")
    assert (after[0] - inferences, after[1] - executions) == (4, 4)


# -- cancellation ----------------------------------------------------------------------------
def _failures(server: RunningServer, model: str, reason: str) -> int:
    with urllib.request.urlopen(server.metrics_url, timeout=DEADLINE_S) as response:
        text = response.read().decode()
    labels = f'model="{model}",reason="{reason}",version="1"'
    found = re.search(rf"^nv_inference_request_failure{{{labels}}} (\S+)$", text, re.MULTILINE)
    assert found is not None, text
    return int(float(found[1]))


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_a_cancelled_grpc_request_leaves_the_queue_unexecuted(
    client: Any, server: RunningServer, tmp_path: Path, how: str
) -> None:
    inferences, _, _ = counts(client, "batched")
    cancelled_before = _failures(server, "batched", "CANCELED")
    gate = Gate(client, "batched", tmp_path)
    own = grpcclient.InferenceServerClient(server.grpc_url)
    doomed = Pending(own, "batched", 3.0)
    wait_pending(server, "batched", 1)
    if how == "cancel":
        doomed.call.cancel()
    else:  # the client goes away: its channel closes
        own.close()
    wait_pending(server, "batched", 0)  # gone from the queue while the instance is busy
    assert "CANCELLED" in str(doomed.error().status())
    own.close()
    first = gate.release()
    after = Pending(client, "batched", 4.0).result()
    print("gate:", first, "next:", after)
    assert after["EXECUTION"] == first["EXECUTION"] + 1  # nothing ran in between
    assert counts(client, "batched")[0] - inferences == 2  # the gate and the next one
    assert _failures(server, "batched", "CANCELED") == cancelled_before + 1


def _http_infer_bytes(model: str, value: float) -> bytes:
    body = json.dumps({
        "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [value]}]
    }).encode()  # fmt: skip
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: test\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@pytest.mark.parametrize("how", ["close", "reset"])
def test_an_http_client_that_goes_away_leaves_the_queue_unexecuted(
    client: Any, server: RunningServer, tmp_path: Path, how: str
) -> None:
    inferences, _, _ = counts(client, "serial")
    gate = Gate(client, "serial", tmp_path)
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=DEADLINE_S)
    sock.sendall(_http_infer_bytes("serial", 3.0))
    wait_pending(server, "serial", 1)
    if how == "reset":  # an abortive close: RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    wait_pending(server, "serial", 0)
    first = gate.release()
    after = Pending(client, "serial", 4.0).result()
    assert after["EXECUTION"] == first["EXECUTION"] + 1
    assert counts(client, "serial")[0] - inferences == 2
