"""BLS calls that go straight from the caller's worker to the callee's instance, not through the
server (server/core/calls/direct_broker.py, worker/bls/direct_caller.py), through a real server
driven by unmodified tritonclient:

- they do not pass through the server: with the server stopped (SIGSTOP), calls run,
  also those of a model that calls itself (each to an instance not waiting on the call);
- the callee's statistics count them by the time the caller's client has its response,
  also down a chain of direct calls (a callee's own calls, forwarded by its caller);
- the caller checks a call as the server would: the same error, counted as a failure;
- two calls at once to one instance (the second goes through the server);
- a callee that dies mid-call fails the call; restarted, it is called again;
- an unloaded callee gets the server's error; reloaded, it is called again;
- a client's region passed on by reference: the callee writes into it in place, and
  unmaps it when the region is unregistered.

test_bls.py's calls (sync, async, gather, zero copy, errors) go this way too where the
callee allows it; its timeout and decoupled calls go through the server.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, FifoGate, RunningServer, repository_of, run_server

DEADLINE_S = 60.0
MODELS = ("bls_direct", "double", "crash", "in_place", "relay", "recursive")


@pytest.fixture(scope="module", params=[(), ("--busy-poll-us", "300")], ids=["", "busy-poll"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningServer]:
    """Each test runs twice: with workers that sleep while they wait, and with workers
    that poll (a callee then looks at its callers' connections and the server's channel
    in turn, reading what it finds)."""
    models = (TEST_MODELS / name for name in MODELS)
    repository = repository_of(tmp_path_factory.mktemp("direct_repo"), *models)
    with run_server(repository, *request.param) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as triton:
        yield triton


def fp32(values: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values.astype(np.float32))
    return tensor


def call(client: Any, mode: str, x: np.ndarray, **params: Any) -> grpcclient.InferResult:
    return client.infer("bls_direct", [fp32(x)], parameters={"mode": mode, **params})


def statistics(client: grpcclient.InferenceServerClient, model: str) -> dict[str, int]:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    inference = stats["inference_stats"]
    return {
        "inferences": int(stats.get("inference_count", 0)),
        "executions": int(stats.get("execution_count", 0)),
        "success": int(inference["success"].get("count", 0)),
        "queue": int(inference["queue"].get("count", 0)),
        "compute_infer": int(inference["compute_infer"].get("count", 0)),
        "fail": int(inference["fail"].get("count", 0)),
    }


def read_line(fifo: Path) -> bytes:
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        readable, _, _ = select.select([fd], [], [], DEADLINE_S)
        assert readable, f"nothing came on {fifo.name}"
        return os.read(fd, 64)
    finally:
        os.close(fd)


def test_calls_run_while_the_server_is_stopped(
    server: RunningServer, client: grpcclient.InferenceServerClient, tmp_path: Path
) -> None:
    """The caller makes one call (it asks the server for the connection), then three more
    while the server is stopped: a call through the server would wait for it forever."""
    gate = FifoGate(tmp_path)
    done = tmp_path / f"done-{uuid.uuid4().hex}"
    os.mkfifo(done)
    before = statistics(client, "double")["inferences"]
    results: queue.Queue[Any] = queue.Queue()
    x = np.arange(5, dtype=np.float32)
    params = {"mode": "stopped", **gate.parameters, "done": str(done)}
    client.async_infer("bls_direct", [fp32(x)], lambda result, error: results.put(error or result),
                       parameters=params)  # fmt: skip
    gate.wait_started(DEADLINE_S)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        gate.open()
        assert read_line(done) == b"done\n"  # the three calls ran with the server stopped
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    outcome = results.get(timeout=DEADLINE_S)
    assert not isinstance(outcome, Exception), outcome
    np.testing.assert_array_equal(outcome.as_numpy("OUTPUT0"), x * 2)
    assert statistics(client, "double")["inferences"] == before + 4


def test_a_model_calls_itself_while_the_server_is_stopped(
    server: RunningServer, client: grpcclient.InferenceServerClient, tmp_path: Path
) -> None:
    """recursive (3 instances) recurses twice with DEPTH 2, the second time with the server
    stopped: each call goes to an instance of its own model that is not waiting on it."""
    gate = FifoGate(tmp_path)
    done = tmp_path / f"done-{uuid.uuid4().hex}"
    os.mkfifo(done)
    results: queue.Queue[Any] = queue.Queue()
    depth = grpcclient.InferInput("DEPTH", [1], "UINT8")
    depth.set_data_from_numpy(np.array([2], dtype=np.uint8))
    client.async_infer("recursive", [depth], lambda result, error: results.put(error or result),
                       parameters={**gate.parameters, "done": str(done)})  # fmt: skip
    gate.wait_started(DEADLINE_S)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        gate.open()
        assert read_line(done) == b"done\n"  # the second recursion ran with the server stopped
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    outcome = results.get(timeout=DEADLINE_S)
    assert not isinstance(outcome, Exception), outcome
    added = {"bool_2": True, "int_2": 2, "str_2": "2", "bool_1": True, "int_1": 1, "str_1": "1"}
    assert json.loads(outcome.as_numpy("PARAMETERS")[0]) == added


def test_the_callee_s_statistics_count_direct_calls(
    client: grpcclient.InferenceServerClient,
) -> None:
    before = statistics(client, "double")
    x = np.array([1.5, -2.0], dtype=np.float32)
    result = call(client, "calls", x, count=5)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
    after = statistics(client, "double")  # counted before the caller's response left
    assert {key: after[key] - before[key] for key in after} == {**dict.fromkeys(after, 5),
                                                                 "fail": 0}  # fmt: skip


def test_statistics_count_a_chain_of_direct_calls(
    client: grpcclient.InferenceServerClient,
) -> None:
    """relay calls bls_direct, which calls double three times: each callee's statistics
    count its calls by the time relay's client has its response."""
    before = {name: statistics(client, name) for name in ("bls_direct", "double")}
    x = np.array([0.5, 4.0], dtype=np.float32)
    relayed = fp32(x)
    result = client.infer("relay", [relayed], parameters={"count": 3})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
    after = {name: statistics(client, name) for name in ("bls_direct", "double")}
    counted = {name: after[name]["success"] - before[name]["success"] for name in after}
    assert counted == {"bls_direct": 1, "double": 3}
    assert after["double"]["inferences"] - before["double"]["inferences"] == 3


def test_a_call_the_callee_would_refuse_gets_the_server_s_error(
    client: grpcclient.InferenceServerClient,
) -> None:
    """The caller checks the call with the callee's config, as the server would: the same
    message, and the callee's statistics count a failure."""
    before = statistics(client, "double")
    expected = "inference input 'INPUT0' data-type is 'INT32', but model 'double' expects 'FP32'"
    with pytest.raises(InferenceServerException, match=expected):
        call(client, "invalid", np.array([1.0], dtype=np.float32))
    after = statistics(client, "double")
    assert (after["fail"], after["inferences"]) == (before["fail"] + 1, before["inferences"])


def test_two_calls_at_once_to_one_instance(client: grpcclient.InferenceServerClient) -> None:
    x = np.linspace(0, 1, 7, dtype=np.float32)
    result = call(client, "same", x)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x * 2)


def test_a_callee_that_dies_fails_the_call_and_is_called_again_once_restarted(
    client: grpcclient.InferenceServerClient,
) -> None:
    x = np.array([1.0, 2.0], dtype=np.float32)
    np.testing.assert_array_equal(call(client, "crash", x).as_numpy("OUTPUT0"), x)
    with pytest.raises(InferenceServerException, match="Stub process 'crash_0_0' is not healthy"):
        call(client, "crash", np.array([-1.0], dtype=np.float32))
    while not client.is_model_ready("crash"):  # a restart takes as long as it takes
        pass
    for _ in range(3):  # through the server while it restarts, then directly again
        np.testing.assert_array_equal(call(client, "crash", x).as_numpy("OUTPUT0"), x)


def test_an_unloaded_callee_fails_and_a_reloaded_one_is_called_again(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    repository = repository_of(tmp_path_factory.mktemp("direct_reload"),
                               *(TEST_MODELS / name for name in MODELS))  # fmt: skip
    options = ("--model-control-mode", "explicit", "--load-model", "bls_direct",
               "--load-model", "double")  # fmt: skip
    x = np.array([3.0], dtype=np.float32)
    with (
        run_server(repository, *options) as running,
        grpcclient.InferenceServerClient(running.grpc_url) as client,
    ):
        doubled = call(client, "calls", x, count=2).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(doubled, x * 2)
        client.unload_model("double")
        with pytest.raises(InferenceServerException, match="Model 'double' is not ready"):
            call(client, "calls", x, count=1)
        client.load_model("double")
        before = statistics(client, "double")["inferences"]
        doubled = call(client, "calls", x, count=3).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(doubled, x * 2)
        assert statistics(client, "double")["inferences"] == before + 3


def mapping_pids(server: RunningServer, key: str) -> list[int]:
    """The server's processes that map the shared-memory object ``key``."""
    root = psutil.Process(server.process.pid)
    path = f"/dev/shm/{key.lstrip('/')}"
    pids = [root.pid] + [child.pid for child in root.children(recursive=True)]
    return [pid for pid in pids if path in Path(f"/proc/{pid}/maps").read_text()]


def test_a_client_region_passed_on_is_written_in_place_and_unmapped_when_it_goes(
    server: RunningServer, client: grpcclient.InferenceServerClient
) -> None:
    x = np.arange(6, dtype=np.float32)
    key = f"/direct_{uuid.uuid4().hex[:12]}"
    region = shm.create_shared_memory_region(key[1:], key, x.nbytes)
    try:
        shm.set_shared_memory_region(region, [x])
        client.register_system_shared_memory(key[1:], key, x.nbytes)
        tensor = grpcclient.InferInput("INPUT0", [x.size], "FP32")
        tensor.set_shared_memory(key[1:], x.nbytes)
        result = client.infer("bls_direct", [tensor], parameters={"mode": "in_place"})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x + 1)  # what it returned
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + 1)  # the caller sees it
        np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, [x.size]),
                                      x + 1)  # the client too: one memory  # fmt: skip
        assert len(mapping_pids(server, key)) == 2  # the caller's worker and the callee's
        client.unregister_system_shared_memory(key[1:])
        call(client, "calls", x, count=1)  # each worker reads its unmap notice before these
        client.infer("in_place", [fp32(x)])
        assert mapping_pids(server, key) == []
    finally:
        shm.destroy_shared_memory_region(region)
