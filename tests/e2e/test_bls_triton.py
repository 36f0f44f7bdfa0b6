"""BLS as Triton's python_backend documents it, through a real server driven by unmodified
tritonclient; each test runs with calls to plain models going straight to the callee's
instance and (--bls-direct false) with every call through the server:

- a model may call itself (recursion with a counter), passing ``parameters=`` on; a call
  that no instance could run (its chain holds every one) fails at once, not hangs;
- ``timeout`` is in microseconds: it is the callee's request timeout (its queue policy
  applies it, ``request.timeout()`` returns it), a very large one is accepted;
- a decoupled callee's response iterator gives all its responses, and gives them again;
- a wrong number of inputs is reported before a wrong type, in Triton's words; a model or
  version that is not served gets Triton's "is not ready";
- BLS in a process the model forked fails at once; BLS in initialize and finalize fails
  with Triton's message.
"""

from __future__ import annotations

import json
import os
import queue
import select
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import (
    EXAMPLES,
    TEST_MODELS,
    FifoGate,
    RunningServer,
    repository_of,
    run_server,
    stop_server,
)

DEADLINE_S = 60.0
MODELS = ("recursive", "timeout_echo", "bls_report", "bls_phases", "bls_in_initialize",
          "double", "repeat")  # fmt: skip
OUTSIDE_EXECUTE = "BLS is only supported during the 'execute' function."


@pytest.fixture(scope="module", params=["true", "false"], ids=["direct", "through-server"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningServer]:
    """Explicit model control: bls_in_initialize, which cannot load, is not loaded."""
    models = [TEST_MODELS / name for name in MODELS]
    repository = repository_of(tmp_path_factory.mktemp("bls_triton"), *models,
                               EXAMPLES / "add_sub")  # fmt: skip
    loaded = [f"--load-model={name}" for name in (*MODELS, "add_sub")
              if name != "bls_in_initialize"]  # fmt: skip
    options = ("--model-control-mode", "explicit", "--bls-direct", request.param, *loaded)
    with run_server(repository, *options) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as triton:
        yield triton


def reported(client: grpcclient.InferenceServerClient, mode: str, **params: Any) -> Any:
    result = client.infer("bls_report", [], parameters={"mode": mode, **params},
                          client_timeout=DEADLINE_S)  # fmt: skip
    return json.loads(result.as_numpy("REPORT")[0])


def recursive(
    client: grpcclient.InferenceServerClient, depth: int, **params: Any
) -> dict[str, Any]:
    tensor = grpcclient.InferInput("DEPTH", [1], "UINT8")
    tensor.set_data_from_numpy(np.array([depth], dtype=np.uint8))
    result = client.infer("recursive", [tensor], parameters=params or None,
                          client_timeout=DEADLINE_S)  # fmt: skip
    parameters: dict[str, Any] = json.loads(result.as_numpy("PARAMETERS")[0])
    return parameters


def added_by(*depths: int) -> dict[str, Any]:
    """What each call of the recursion adds to the parameters it passes on."""
    params: dict[str, Any] = {}
    for depth in depths:
        params.update({f"bool_{depth}": True, f"int_{depth}": depth, f"str_{depth}": str(depth)})
    return params


def successes(client: grpcclient.InferenceServerClient, model: str) -> int:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats["inference_stats"]["success"].get("count", 0))


# -- a model that calls itself ------------------------------------------------------------


@pytest.mark.parametrize("via", ["exec", "async_exec"])
def test_a_model_calls_itself_passing_its_parameters_on(
    client: grpcclient.InferenceServerClient, via: str
) -> None:
    """recursive has 3 instances: DEPTH 2 is the client's request and two calls, each on
    an instance of its own; the parameters of each call reach the next in
    request.parameters(), with their types."""
    assert recursive(client, 2, via=via) == {"via": via, **added_by(2, 1)}
    assert recursive(client, 1) == added_by(1)
    assert recursive(client, 0, start="here") == {"start": "here"}


def test_a_call_no_instance_is_left_for_fails_at_once(
    client: grpcclient.InferenceServerClient,
) -> None:
    """DEPTH 3 needs a fourth instance: the last call finds all 3 waiting on its own chain
    and fails at once (it could only wait for itself); the instances are free again."""
    with pytest.raises(InferenceServerException) as raised:
        recursive(client, 3)
    message = raised.value.message()
    assert "circular BLS call recursive -> recursive -> recursive -> recursive" in message
    assert "every instance of model 'recursive' (3) is already waiting" in message
    assert recursive(client, 2) == added_by(2, 1)


def test_a_call_never_waits_for_an_instance_of_its_own_chain(
    client: grpcclient.InferenceServerClient,
) -> None:
    """bls_report calls recursive, directly where it can: the first instance runs it and
    calls recursive again with a timeout, which goes through the server. That instance
    waits for the call, so the server gives it to another (it may look free to the server,
    whose queue does not see direct calls), and the recursion ends well before the 30 s."""
    found = reported(client, "recursive", depth=2, call_timeout=30_000_000)
    assert found == {"PARAMETERS": {"call_timeout": 30_000_000, **added_by(2, 1)}}


# -- timeout -----------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["exec", "async_exec"])
def test_a_call_s_timeout_reaches_the_callee_in_microseconds(
    client: grpcclient.InferenceServerClient, via: str
) -> None:
    """request.timeout() in the callee is the caller's timeout, unchanged (microseconds,
    as in Triton); 11000000000 (about three hours) is a timeout like any other."""
    for timeout in (123_456_789, 11_000_000_000):
        assert reported(client, "timeout", call_timeout=timeout, via=via) == {"timeout": timeout}


def test_a_client_s_timeout_reaches_the_model(client: grpcclient.InferenceServerClient) -> None:
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
    result = client.infer("timeout_echo", [tensor], timeout=777)  # microseconds
    assert result.as_numpy("TIMEOUT").tolist() == [[777]]
    assert json.loads(result.as_numpy("PARAMETERS")[0][0]) == {}  # the server's, not the model's


def test_a_call_s_timeout_applies_while_it_waits_in_the_callee_s_queue(
    client: grpcclient.InferenceServerClient, tmp_path: Path
) -> None:
    """timeout_echo is held by a client's request; a call with a 0.1 s timeout waits in
    its queue, which refuses it when its time is up: the callee never runs it."""
    gate = FifoGate(tmp_path)
    held: queue.Queue[Any] = queue.Queue()
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
    before = successes(client, "timeout_echo")
    client.async_infer("timeout_echo", [tensor], lambda result, error: held.put(error or result),
                       parameters=gate.parameters)  # fmt: skip
    gate.wait_started(DEADLINE_S)
    try:
        found = reported(client, "timeout", call_timeout=100_000)
        assert found == {"error": "Request timeout expired"}
    finally:
        gate.open()
    assert not isinstance(held.get(timeout=DEADLINE_S), Exception)
    client.infer("timeout_echo", [tensor])  # queued behind anything still there
    assert successes(client, "timeout_echo") == before + 2  # not the refused call


# -- decoupled callees -------------------------------------------------------------------


@pytest.mark.parametrize("via", ["exec", "async_exec"])
def test_a_decoupled_callee_s_responses_are_all_given_and_given_again(
    client: grpcclient.InferenceServerClient, via: str
) -> None:
    """repeat sends 4 responses and a bare final one: 5 in all. The iterator gives them
    all, and once they have all come, each new loop starts over from the first; a loop
    left early is resumed by the next, which then ends."""
    assert reported(client, "iterate", count=4, via=via) == {
        "first": 0,
        "rest": [1, 2, 3, None],
        "again": [5, 5],
        "partial": 2,
        "resumed": 2,
        "exhausted": True,
    }


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["exec", "async_exec"])
def test_wrong_inputs_are_reported_in_triton_s_order_and_words(
    client: grpcclient.InferenceServerClient, via: str
) -> None:
    found = reported(client, "wrong_inputs", via=via)
    assert (
        "expected 2 inputs but got 1 inputs for model 'add_sub'. Got input(s) ['INPUT0'], "
        "but missing required input(s) ['INPUT1']. Please provide all required input(s)."
    ) in found["count"]  # not the type of INPUT0, which is wrong too
    assert (
        "inference input 'INPUT1' data-type is 'FP64', but model 'add_sub' expects 'FP32'"
    ) in found["dtype"]
    [decoupled] = found["decoupled"]
    assert (
        "expected 1 inputs but got 0 inputs for model 'repeat'. Got input(s) [], but "
        "missing required input(s) ['COUNT']. Please provide all required input(s)."
    ) in decoupled


@pytest.mark.parametrize("via", ["exec", "async_exec"])
def test_a_model_that_is_not_served_is_not_ready(
    client: grpcclient.InferenceServerClient, via: str
) -> None:
    found = reported(client, "not_ready", via=via)
    missing = "Failed for execute the inference request. Model 'no_such_model' is not ready."
    assert found == {
        "model": missing,
        "version": "Failed for execute the inference request. Model 'double' is not ready.",
        "decoupled": [missing],
    }


# -- where BLS can be used ---------------------------------------------------------------


def test_bls_in_a_forked_process_fails_at_once(client: grpcclient.InferenceServerClient) -> None:
    """The forked processes share the instance's connection to the server: their calls
    fail at once with the reason; SIGTERM ends them (the worker ignores it, they must
    not: Pool.terminate would wait for them forever); the model's own calls go on."""
    found = reported(client, "fork")
    assert "cannot be used in a process the model forked" in found["error"]
    assert found["terminable"] is True
    assert found["after"] == 2.0
    assert reported(client, "fork")["after"] == 2.0  # the instance serves on


def test_bls_outside_execute_fails_with_triton_s_message(
    client: grpcclient.InferenceServerClient, tmp_path: Path
) -> None:
    """initialize's calls raised, execute's ran; finalize's raised (it says so on a FIFO
    as the model is unloaded); a model whose initialize lets the error go fails to load."""
    client.load_model("bls_phases")
    finalized = tmp_path / "finalized"
    os.mkfifo(finalized)
    result = client.infer("bls_phases", [], parameters={"finalized": str(finalized)})
    report = json.loads(result.as_numpy("REPORT")[0])
    assert report == {"exec": OUTSIDE_EXECUTE, "async_exec": OUTSIDE_EXECUTE, "execute": 2.0}
    fd = os.open(finalized, os.O_RDONLY | os.O_NONBLOCK)
    try:
        client.unload_model("bls_phases")
        readable, _, _ = select.select([fd], [], [], DEADLINE_S)
        assert readable, "finalize wrote nothing"
        assert os.read(fd, 256).decode() == OUTSIDE_EXECUTE + "\n"
    finally:
        os.close(fd)
    with pytest.raises(InferenceServerException, match=OUTSIDE_EXECUTE.replace(".", r"\.")):
        client.load_model("bls_in_initialize")


def test_forked_callers_leave_the_server_free_to_stop(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    repository = repository_of(tmp_path_factory.mktemp("bls_fork"),
                               TEST_MODELS / "bls_report", TEST_MODELS / "double")  # fmt: skip
    with (
        run_server(repository) as running,
        grpcclient.InferenceServerClient(running.grpc_url) as triton,
    ):
        assert reported(triton, "fork")["after"] == 2.0
        assert stop_server(running, timeout=DEADLINE_S) == 0  # SIGTERM: stopped in time
