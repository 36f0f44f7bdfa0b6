"""A model without dynamic batching and with one instance: one more request waits at the busy
instance, in its worker's socket, so the worker starts it as soon as its execute returns, without
the server (server/core/scheduling/scheduler.py). Such a request still counts as pending, and it is
still the server's: a client that leaves cancels it unrun (test_scheduling.py,
HTTP), and an instance that dies before it started sends it back to the queue."""

from __future__ import annotations

import os
import queue
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, FifoGate, RunningServer, repository_of, run_server, wait_pending

DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    models = (TEST_MODELS / "gated",)
    with run_server(repository_of(tmp_path_factory.mktemp("prefetch_repo"), *models)) as running:
        yield running


class Held:
    """An asynchronous request of a gated model: it writes "started" when its execute
    begins, then waits until the test opens its gate."""

    def __init__(self, client: Any, model: str, folder: Path, value: float) -> None:
        self.gate = FifoGate(folder)
        self.value = value
        control = grpcclient.InferInput("CONTROL", [2], "BYTES")
        control.set_data_from_numpy(np.array([str(self.gate.started), str(self.gate.go)],
                                             dtype=np.object_))  # fmt: skip
        data = grpcclient.InferInput("DATA", [1], "FP32")
        data.set_data_from_numpy(np.array([value], np.float32))
        self._results: queue.Queue[Any] = queue.Queue()
        client.async_infer(model, [control, data], self._done)

    def _done(self, result: Any, error: Any) -> None:
        self._results.put(error if error is not None else result)

    def outcome(self) -> Any:
        return self._results.get(timeout=DEADLINE_S)

    def succeeded(self) -> None:
        result = self.outcome()
        assert not isinstance(result, Exception), result
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [self.value * 2])


def test_the_worker_starts_the_waiting_request_without_the_server(
    server: RunningServer, tmp_path: Path
) -> None:
    """With the server stopped (SIGSTOP), the request waiting at the instance still starts
    when the one before it returns: it was in the worker's socket, not the server's queue."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    first = Held(client, "gated", tmp_path, 1.0)
    first.gate.wait_started(DEADLINE_S)
    second = Held(client, "gated", tmp_path, 2.0)
    wait_pending(server, "gated", 1)  # the second counts as pending while it waits
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        first.gate.open()
        second.gate.wait_started(DEADLINE_S)  # started while the server could do nothing
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    second.gate.open()
    first.succeeded()
    second.succeeded()
    wait_pending(server, "gated", 0)
    client.close()


def test_a_request_waiting_at_an_instance_that_dies_goes_back_to_the_queue(
    server: RunningServer, tmp_path: Path
) -> None:
    """The running request crashes the instance (os._exit): the one waiting behind it had
    not started, so it goes back to the queue and fares as a queued request does while the
    model's only instance restarts (UNAVAILABLE, "restarting"), not as the crashed one;
    the restarted instance serves what comes next."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    crasher = Held(client, "gated", tmp_path, -1.0)
    crasher.gate.wait_started(DEADLINE_S)
    behind = Held(client, "gated", tmp_path, 2.0)
    wait_pending(server, "gated", 1)  # it waits at the instance
    crasher.gate.open()  # the instance exits
    crashed, requeued = crasher.outcome(), behind.outcome()
    assert isinstance(crashed, InferenceServerException), crashed
    assert "Stub process 'gated_0_0' is not healthy." in str(crashed)
    assert isinstance(requeued, InferenceServerException), requeued
    assert "is available (restarting)" in str(requeued), requeued  # failed from the queue
    wait_pending(server, "gated", 0)
    while not client.is_model_ready("gated"):  # the restart; each ask is a round trip
        pass
    after = Held(client, "gated", tmp_path, 3.0)
    after.gate.wait_started(DEADLINE_S)
    after.gate.open()
    after.succeeded()
    client.close()
